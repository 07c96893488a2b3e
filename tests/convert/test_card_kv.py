"""The KV-cache figure convert-gqa prints and writes into the card: per token at the stored dtype, and, where layers
slide, how far that holds (they cache at most their window: the per-token figure counted every layer at every
token without saying so)."""
from __future__ import annotations

import shutil

from families import make_model
from gqakit.cli import convert_main


def test_a_sliding_window_is_named_beside_the_per_token_figure(tmp_path, capsys):
    for family, overrides, note in (("mistral", {}, "; sliding-window layers cache at most 8 tokens each"),
                                    ("llama", {}, ""),
                                    ("qwen2", dict(use_sliding_window=False, sliding_window=16), ""),
                                    # every layer below max_window_layers: none slides (a review)
                                    ("qwen2", dict(use_sliding_window=True, sliding_window=16,
                                                   max_window_layers=8), ""),
                                    ("mistral", dict(sliding_window=4096, max_position_embeddings=512), "")):
        src = make_model(family, tmp_path / family, **overrides)
        capsys.readouterr()
        assert convert_main(["--groups", "1", str(src), "-o", str(tmp_path / f"{family}-mqa"), "--force"]) == 0
        printed = capsys.readouterr()
        line = f"KV cache per token at the stored dtype: 512 -> 128 bytes (4.00x smaller){note}"
        assert line in printed.out + printed.err
        card = (tmp_path / f"{family}-mqa" / "README.md").read_text()
        assert f"| 512 -> 128 bytes (4.00x smaller){note} |" in card
        shutil.rmtree(tmp_path / family)


def test_a_dtype_change_gives_the_ratio_at_one_dtype_too(tmp_path, capsys):
    """A review: bf16 MQA of 8 heads written at --dtype float32 printed "4.00x smaller" (each value twice as wide),
    where the heads alone make it 8x; both are said now, on stdout and in the card. The latent's card names no merge
    method when it merges nothing (it said "mean"), and only a trained latent says "before training"."""
    import torch

    from tiny_models import make_tiny_llama

    src = make_tiny_llama(tmp_path / "bf16", heads=8, head_dim=8, dtype=torch.bfloat16)
    for args, line in ((("--groups", "1", "--dtype", "float32"),
                        "512 -> 128 bytes (4.00x smaller as stored; 8.00x smaller at one dtype: the output stores "
                        "4-byte values, the source 2-byte)"),
                       (("--groups", "1", "--dtype", "bfloat16"), "512 -> 64 bytes (8.00x smaller)")):
        out = tmp_path / "-".join(args)
        capsys.readouterr()
        assert convert_main([*args, str(src), "-o", str(out), "-q"]) == 0
        assert f"KV cache per token at the stored dtype: {line}" in capsys.readouterr().out
        assert f"| {line} |" in (out / "README.md").read_text()
    fitted = tmp_path / "latent"
    assert convert_main(["--groups", "1", "--to", "mla", "--kv-rank", "8", "--rope-dim", "4", str(src), "-o",
                         str(fitted), "-q"]) == 0
    card = (fitted / "README.md").read_text()
    assert "| method | none: the latent is fitted to the K/V heads from the weights alone" in card
    assert "| method | mean" not in card and "before training" not in card

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
        assert f"| 512 -> 128{note} |" in card
        shutil.rmtree(tmp_path / family)

"""Pretrain the embedded reference models from a recipe: a plain, seeded training loop.

    python -m gqakit.reference.train recipes/reference_model.yaml [key=value ...]
    python -m gqakit.reference.train recipes/reference_t5.yaml

Trains a byte-level BPE tokenizer and a small multi-head model on public-domain text, writes a
stock Hugging Face folder (bf16 safetensors, tokenizer, `pretraining.json` with the token/step
budget that later uptraining is measured against as the GQA paper's alpha) and the held-out text.
`architecture: llama` is a decoder trained on next tokens; `architecture: t5` an encoder-decoder (T5 1.0
layout: ReLU, tied embeddings) trained by T5's span corruption (`gqakit.common.span_corruption`), as the GQA
paper's T5 was; its held-out perplexity is over the corrupted spans' targets.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from gqakit.common.atomic import atomic_output, check_replaceable, replace_text
from gqakit.common.errors import GqakitError
from gqakit.common.options import SEED_MAX, check_fields, option
from gqakit.common.recipes import load_recipe, to_dict
from gqakit.uptrain.modeling import lr_factor
from gqakit.reference.tokenizer import EOS, train_bpe


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
    output_dir: str
    heldout_output: str
    architecture: str = option("llama", choices=("llama", "t5"))
    corpora_dir: str = "../shared/corpora"
    train_files: tuple[str, ...] = ()
    heldout_file: str = "austen/emma.txt"
    heldout_chars: int = option(200_000, above=0)
    vocab_size: int = option(8192, above=0)
    hidden_size: int = option(256, above=0)
    intermediate_size: int = option(768, above=0)
    num_hidden_layers: int = option(8, above=0)
    num_attention_heads: int = option(8, above=0)
    num_decoder_layers: int | None = option(None, above=0)  # t5: the decoder's (default: num_hidden_layers)
    sentinels: int = option(64, above=0)  # t5: <extra_id_N> tokens for span corruption
    max_position_embeddings: int = option(1024, above=0)
    rope_theta: float = option(10000.0, above=0)
    seq_len: int = option(512, above=0)
    batch_size: int = option(8, above=0)
    steps: int = option(1000, above=0)
    lr: float = option(2e-3, above=0)
    min_lr_ratio: float = option(0.1, at_least=0, at_most=1)
    warmup_steps: int = option(100, at_least=0)
    weight_decay: float = option(0.1, at_least=0)
    grad_clip: float = option(1.0, above=0)
    eval_every: int = option(250, above=0)
    log_every: int = option(25, above=0)
    seed: int = option(0, at_least=0, at_most=SEED_MAX)
    threads: int = option(2, above=0)

    def __post_init__(self):
        check_fields(self)


def _heldout_text(text: str, chars: int) -> str:
    """The first `chars` characters of `text`, cut back to the last paragraph break."""
    cut = text[:chars]
    return cut[: cut.rfind("\n\n")].strip() + "\n"


def _lr(step: int, cfg: PretrainConfig) -> float:
    return cfg.lr * lr_factor(step, cfg.steps, cfg.warmup_steps, cfg.min_lr_ratio)


def unigram_perplexity(train_ids: list[int], eval_ids: list[int], vocab_size: int) -> float:
    """Perplexity of an add-one-smoothed unigram model fitted on the training tokens."""
    counts = Counter(train_ids)
    total = len(train_ids) + vocab_size
    nll = -sum(math.log((counts[t] + 1) / total) for t in eval_ids[1:])
    return math.exp(nll / (len(eval_ids) - 1))


@torch.no_grad()
def _sample(model, tok, prompt: str, n: int, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    ids = tok(prompt, return_tensors="pt").input_ids
    for _ in range(n):
        logits = model(input_ids=ids[:, -model.config.max_position_embeddings :]).logits[0, -1].float()
        probs = torch.softmax(logits / 0.8, dim=-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)[None]], dim=1)
    return tok.decode(ids[0])


def _build(cfg: PretrainConfig, tok, eos: int):
    """The untrained model: a multi-head Llama, or a multi-head T5 (1.0 layout) with as many decoder layers."""
    from transformers import LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration

    head_dim = cfg.hidden_size // cfg.num_attention_heads
    if cfg.architecture == "t5":
        return T5ForConditionalGeneration(T5Config(
            vocab_size=len(tok), d_model=cfg.hidden_size, d_kv=head_dim, d_ff=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers, num_decoder_layers=cfg.num_decoder_layers or cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads, feed_forward_proj="relu", dropout_rate=0.0, tie_word_embeddings=True,
            pad_token_id=tok.pad_token_id, eos_token_id=eos, decoder_start_token_id=tok.pad_token_id,
        ))
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads, head_dim=head_dim,
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
        tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
        initializer_range=0.02,
    ))


class _Objective:
    """What the architecture trains on and how held-out text is scored: next tokens (llama), or T5's span
    corruption of each window (t5; held-out masks seeded by 0, training masks by the step)."""

    def __init__(self, cfg: PretrainConfig, tok, eos: int):
        from gqakit.common.span_corruption import sentinel_ids

        self.cfg, self.tok, self.eos = cfg, tok, eos
        self.sentinels = sentinel_ids(tok) if cfg.architecture == "t5" else None

    def batch(self, windows: torch.Tensor, step: int) -> dict:
        if self.sentinels is None:
            return {"input_ids": windows, "labels": windows}
        from gqakit.common.span_corruption import corrupt_rows

        inputs, targets = corrupt_rows(windows, self.sentinels, self.eos, seed=self.cfg.seed * 1_000_003 + step)
        return {"input_ids": inputs, "labels": targets}

    def perplexity(self, model, ids: torch.Tensor) -> float:
        from gqakit.evaluate.perplexity import perplexity, span_corruption_nll

        if self.sentinels is None:
            return perplexity(model, ids, self.cfg.seq_len, progress=False)
        nll, count = span_corruption_nll(model, ids, self.cfg.seq_len, self.tok, progress=False)
        return math.exp(nll / count)

    @torch.no_grad()
    def sample(self, model, tok, prompt: str) -> str:
        if self.sentinels is None:
            return _sample(model, tok, prompt, 60, self.cfg.seed)
        from gqakit.common.span_corruption import corrupt

        ids = torch.tensor(tok(prompt).input_ids[:48])
        inputs, _ = corrupt(ids, self.sentinels, self.eos, torch.Generator().manual_seed(self.cfg.seed))
        filled = model.generate(inputs[None], max_new_tokens=32, do_sample=False)[0]
        return f"{tok.decode(inputs)} -> {tok.decode(filled, skip_special_tokens=False)}"


def _check_outputs(cfg: PretrainConfig, heldout: str) -> None:
    """Before any training: the model replaces output_dir only where that is a model this script made (or empty,
    or absent), and heldout_output is written only where it is absent or already holds this very text."""
    check_replaceable(Path(cfg.output_dir), "output_dir", "this script")
    held = Path(cfg.heldout_output)
    if held.is_dir() or (held.exists() and held.read_bytes() != heldout.encode("utf-8")):
        raise GqakitError(f"heldout_output {held} exists and holds something else than this recipe's held-out "
                          "text; remove it yourself or choose another heldout_output")


def train(cfg: PretrainConfig) -> dict:
    from transformers import GenerationConfig

    root = Path(cfg.corpora_dir)
    missing = [f for f in (*cfg.train_files, cfg.heldout_file) if not (root / f).is_file()]
    if missing:
        raise GqakitError(f"the corpus file {root / missing[0]} is missing ({len(missing)} of "
                          f"{len(cfg.train_files) + 1} are); set corpora_dir=FOLDER to a folder holding "
                          f"{', '.join((*cfg.train_files, cfg.heldout_file))} (../shared/corpora has them)")
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    docs = [(root / f).read_text(encoding="utf-8") for f in cfg.train_files]
    heldout = _heldout_text((root / cfg.heldout_file).read_text(encoding="utf-8"), cfg.heldout_chars)
    _check_outputs(cfg, heldout)

    t0 = time.time()
    tok = train_bpe(docs, cfg.vocab_size, cfg.sentinels if cfg.architecture == "t5" else 0)
    eos = tok.convert_tokens_to_ids(EOS)
    stream: list[int] = []
    for doc in docs:
        stream += tok(doc).input_ids + [eos]
    data = torch.tensor(stream)
    eval_ids = torch.tensor(tok(heldout).input_ids)
    print(f"tokenizer: {len(tok)} tokens in {time.time() - t0:.0f}s; train {data.numel():,} tokens, "
          f"held-out {eval_ids.numel():,} tokens", flush=True)

    model = _build(cfg, tok, eos)
    objective = _Objective(cfg, tok, eos)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed)
    eval_slice = eval_ids[: 16 * cfg.seq_len]
    history = []
    t0 = time.time()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg)
        starts = torch.randint(0, data.numel() - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
        batch = torch.stack([data[s : s + cfg.seq_len] for s in starts.tolist()])  # (B, T)
        loss = model(**objective.batch(batch, step)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            rate = (step + 1) * cfg.batch_size * cfg.seq_len / (time.time() - t0)
            print(f"step {step:5d}  loss {loss.item():.4f}  lr {_lr(step, cfg):.2e}  {rate:,.0f} tok/s",
                  flush=True)
        if (step + 1) % cfg.eval_every == 0 or step == cfg.steps - 1:
            model.eval()
            ppl = objective.perplexity(model, eval_slice)
            model.train()
            history.append({"step": step + 1, "loss": loss.item(), "heldout_ppl_16w": ppl})
            print(f"step {step + 1:5d}  held-out perplexity (first 16 windows) {ppl:.2f}", flush=True)
    train_seconds = time.time() - t0

    # Evaluate what ships: the bf16 weights, computed in fp32.
    model = model.to(torch.bfloat16).float().eval()
    heldout_ppl = objective.perplexity(model, eval_ids)
    unigram_ppl = unigram_perplexity(stream, eval_ids.tolist(), len(tok))
    prompts = (heldout[:300],) if cfg.architecture == "t5" else ("Emma was", "\"My dear sister,\" said")
    samples = [objective.sample(model, tok, p) for p in prompts]
    record = {
        "pretraining_tokens": cfg.steps * cfg.batch_size * cfg.seq_len,
        "pretraining_steps": cfg.steps,
        "tokens_per_step": cfg.batch_size * cfg.seq_len,
        "train_corpus_tokens": data.numel(),
        "parameters": n_params,
        "train_seconds": round(train_seconds),
        "heldout": {"file": cfg.heldout_file, "chars": len(heldout), "tokens": eval_ids.numel(),
                    "perplexity": heldout_ppl, "unigram_perplexity": unigram_ppl,
                    "window": cfg.seq_len, "stride": cfg.seq_len,
                    "objective": "span_corruption" if cfg.architecture == "t5" else "next_token"},
        "history": history,
        "samples": samples,
        "recipe": to_dict(cfg),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
    }
    with atomic_output(Path(cfg.output_dir), force=True) as tmp:  # the recipe's own folder: rebuilt in place
        model.to(torch.bfloat16).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if cfg.architecture == "t5":
            GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id,
                             decoder_start_token_id=tok.pad_token_id).save_pretrained(tmp)
        else:
            GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos).save_pretrained(tmp)
        (tmp / "pretraining.json").write_text(json.dumps(record, indent=2) + "\n")
    replace_text(Path(cfg.heldout_output), heldout)
    print(json.dumps({k: record[k] for k in ("pretraining_tokens", "pretraining_steps", "heldout")}, indent=2))
    print("\n".join(samples))
    return record


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit("usage: python -m gqakit.reference.train RECIPE.yaml [key=value ...]")
    try:
        train(load_recipe(PretrainConfig, argv[0], argv[1:]))
    except GqakitError as e:  # one line and exit 2, as the console scripts do
        sys.stderr.write(f"python -m gqakit.reference.train: error: {e}\n")
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()

"""`gqakit sample`: calibration text drawn from the model itself, for when no text of its training domain is at hand.

A merge fitted or trained on calibration windows learns the original attention on the inputs those windows give it; with
one K/V head for many query heads it cannot keep everything, and what it keeps follows the calibration text's domain.
SmolLM2-135M trained on *Pride and Prejudice* reproduces its original attention on held-out Austen far better than on
Wikipedia (docs/results/transfer.md, "Calibration text"). The model's own samples are the nearest thing to its training
distribution that needs no data at all: each sample starts a new document (the tokenizer's BOS, or its EOS where it has
none) and draws `length` tokens at temperature 1 from the model's full distribution (top-p 1), as data-free distillation
does (LLM-QAT, arXiv 2305.17888, samples its own training data the same way).

The output is one JSON-lines file, one `{"text": ...}` row per sample, that `convert-gqa --calibration` (and
`gqakit eval`'s `--dataset`) reads as documents; it is written under the hidden working name of
`common.atomic.sibling` and renamed into place, so an interrupted run leaves nothing behind (and what a killed
one left, the next run removes, as for the other commands' outputs).

The sampler is `gqakit.decode.sampling`: a hand-written loop over a static KV cache, the rows dealt over one-threaded
Python threads, in bf16 where the hardware has bf16 units (`--dtype auto`). Each row draws from its own generator,
seeded by the seed and the row's index, so a sample does not depend on --batch-size (up to the last bits of the
logits, which batching may change); deterministic for a seed on one machine.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path

from gqakit.common.atomic import inside, remove_stale_leftovers, sibling
from gqakit.common.dtypes import NAMES
from gqakit.common.errors import GqakitError, opt
from gqakit.common.options import SEED_MAX, FieldError, check_fields, flags, option
from gqakit.common.precision import auto_dtype


DTYPES = ("auto", *NAMES)  # --dtype; auto: bfloat16 where the device has bf16 units
BATCH = 64  # samples drawn at once: gqakit sample's --batch-size and data-free calibration's


@dataclasses.dataclass(frozen=True)
class SampleConfig:
    """`gqakit sample`'s options, checked on construction (`gqakit.common.options`)."""

    model: str = option(flag="MODEL", help="Hugging Face checkpoint folder (a decoder) to sample from")
    output: str = option(flag="-o/--output", metavar="FILE.jsonl",
                         help="the JSON-lines file to write, one {\"text\": ...} row per sample")
    tokens: int = option(65_536, at_least=1, help="tokens to sample in all, rounded up to whole samples")
    length: int = option(512, at_least=1, help="tokens per sample, a calibration window")
    batch_size: int = option(BATCH, at_least=1, help="samples drawn at once (dealt over torch's threads)")
    temperature: float = option(1.0, above=0.0, help="softmax temperature; 1.0: the model's distribution")
    top_p: float = option(1.0, above=0.0, at_most=1.0,
                          help="nucleus probability mass kept, in (0, 1]; 1.0 = every token")
    seed: int = option(0, at_least=0, at_most=SEED_MAX, help="seed of the sampler")
    dtype: str = option("auto", choices=DTYPES, help="compute dtype; auto: bfloat16 where the device has bf16 units "
                                                      "(avx512_bf16, amx_bf16, a recent GPU), else float32")
    force: bool = option(False, help="replace an existing -o file")
    progress: bool = option(True, flag="-q/--quiet", invert=True, help="no progress bar")

    def __post_init__(self):
        try:
            check_fields(self)
        except FieldError as e:  # name the flag the user typed, not the field
            flag = flags(SampleConfig).get(e.field, e.field)
            raise GqakitError(str(e).replace(f"{e.field}=", f"{flag} ", 1)) from None
        if not self.output.endswith(".jsonl"):
            raise GqakitError(f"-o {self.output}: name the output FILE.jsonl (JSON lines, as --calibration reads)")


def start_token(tokenizer) -> int:
    """The token that begins a new document: BOS, or EOS (the document separator) where there is no BOS. Of a
    tokenizer, or of a model's config where no text is read (data-free calibration)."""
    for name in ("bos_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, (list, tuple)):  # a config may list several end tokens
            value = value[0] if value else None
        if value is not None:
            return int(value)
    what = "tokenizer" if hasattr(tokenizer, "decode") else "model's config"
    raise GqakitError(f"the {what} has neither a BOS nor an EOS token to start a document with; "
                      "pass calibration text with convert-gqa --calibration instead")


def sample_ids(model, start: int, count: int, length: int, temperature: float, top_p: float, seed: int,
               first_row: int = 0, on_step=None):
    """(count, length) token ids: each row `length` tokens sampled after the token `start`, row i from a generator
    seeded by `seed` and `first_row + i` (`gqakit.decode.sampling.sample_tokens`). The end-of-text token is held
    back until `length` tokens (as transformers' min_new_tokens holds it), so no row stops early. `on_step(rows)`
    after each decoding step, for a progress bar."""
    from gqakit.decode.sampling import sample_tokens

    return sample_tokens(model, start, count, length, temperature=temperature, top_p=top_p, seed=seed,
                         first_row=first_row, on_step=on_step)


def sampled_batches(model, start: int, samples: int, length: int, temperature: float, top_p: float, seed: int,
                    batch_size: int, on_step=None):
    """`samples` rows of `length` sampled tokens (`sample_ids`), `batch_size` at a time; a row depends on the seed
    and its index alone: yields (count, length) id tensors."""
    for first in range(0, samples, batch_size):
        count = min(batch_size, samples - first)
        yield sample_ids(model, start, count, length, temperature, top_p, seed, first_row=first, on_step=on_step)


def progress_step(bar):
    """`on_step` for a tqdm bar updated from several threads: each decoding step's tokens, under a lock, so the bar
    shows tokens/s as they are drawn."""
    import threading

    lock = threading.Lock()

    def on_step(tokens: int) -> None:
        with lock:
            bar.update(tokens)

    return on_step


def sample(cfg: SampleConfig) -> dict:
    """Write cfg.tokens (rounded up to whole samples) of the model's own text to cfg.output; returns a summary."""
    from tqdm.auto import tqdm

    from gqakit.hf.fields import context_length
    from gqakit.hf.loading import load_model, resolve_device

    out = Path(cfg.output)
    if out.is_dir():
        raise GqakitError(f"-o {out} is a folder; name a FILE.jsonl to write")
    if Path(cfg.model).is_dir() and inside(out.parent, Path(cfg.model)):  # a conversion would copy it as a side file
        raise GqakitError(f"-o {out} is inside the model folder {cfg.model}; write it outside the model")
    if out.exists() and not cfg.force:
        raise GqakitError(f"{out} already exists; pass {opt('force')} to replace it or choose another -o")
    if not out.parent.exists():
        raise GqakitError(f"the folder of -o {out} does not exist; create it first")
    model, tokenizer = load_model(cfg.model, dtype=auto_dtype(cfg.dtype, resolve_device()))
    context = context_length(model.config.to_dict())
    if context and cfg.length > context:  # positions past it were never trained (or do not exist)
        raise GqakitError(f"{opt('length', cfg.length)} is past the model's {context:,}-token context, whose later "
                          f"positions it never saw; use {opt('length')} <= {context:,}, as convert-gqa's "
                          "--calibration-window must be")
    start = start_token(tokenizer)
    samples = math.ceil(cfg.tokens / cfg.length)
    remove_stale_leftovers(out)
    tmp = sibling(out, "tmp")
    t0 = time.perf_counter()
    bar = tqdm(total=samples * cfg.length, desc="sample", unit="tok", unit_scale=True, disable=not cfg.progress)
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            for ids in sampled_batches(model, start, samples, cfg.length, cfg.temperature, cfg.top_p, cfg.seed,
                                       cfg.batch_size, on_step=progress_step(bar)):
                for row in ids.tolist():
                    fh.write(json.dumps({"text": tokenizer.decode(row, skip_special_tokens=True)}) + "\n")
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    return {"output": str(out), "samples": samples, "tokens": samples * cfg.length, "seconds": seconds}

"""The options of `gqakit eval ppl | stream | passkey | niah`: one frozen dataclass per command, each field declared
once with its flag (`common.options.option(help=...)`); `evaluate/cli.py` builds the parsers from them. No torch here:
`gqakit --help` stays fast."""
from __future__ import annotations

import dataclasses
import re

from gqakit.attention import kinds as attention_kinds
from gqakit.common import dtypes
from gqakit.common.errors import GqakitError, opt
from gqakit.common.options import SEED_MAX, check_fields, each_once, option
from gqakit.evaluate.cache_kinds import DEFAULT_KV_CHUNK, KV_CACHES
from gqakit.evaluate.needles import TASKS, parse_haystacks, parse_tasks


def parse_lengths(spec: str) -> list[int]:
    """'1k,2k,4096' -> [1024, 2048, 4096] (k = 1024 tokens)."""
    out = []
    for part in (p.strip().lower() for p in spec.split(",") if p.strip()):
        match = re.fullmatch(r"(\d+(?:\.\d+)?)(k?)", part)
        if not match:
            raise GqakitError(f"{opt('lengths')}: cannot read {part!r}; give token counts like 1k,2k,4096")
        value = float(match.group(1)) * (1024 if match.group(2) else 1)
        if value != int(value) or value < 1:
            raise GqakitError(f"{opt('lengths')}: {part!r} is not a whole positive number of tokens")
        out.append(int(value))
    if not out:
        raise GqakitError(f"{opt('lengths')} is empty; give token counts like 1k,2k,4k")
    return each_once(out, opt("lengths"))


def parse_depths(spec: str) -> list[float]:
    """'0,0.5,1' -> [0.0, 0.5, 1.0], each in [0, 1]."""
    try:
        out = [float(p) for p in spec.split(",") if p.strip()]
    except ValueError:
        raise GqakitError(f"{opt('depths')}: cannot read {spec!r}; give fractions like 0,0.25,0.5,0.75,1") from None
    if not out or any(not 0.0 <= d <= 1.0 for d in out):
        raise GqakitError(f"{opt('depths', repr(spec))}: give fractions in [0, 1], e.g. 0,0.25,0.5,0.75,1")
    return each_once(out, opt("depths"))




def _policies(spec: str) -> tuple[str, ...]:
    return tuple(each_once([p.strip() for p in spec.split(",") if p.strip()], opt("policies")))


# Fields several commands share, declared once each.
def _text():
    return option(None, help="a UTF-8 .txt file (one document)")


def _dataset():
    return option(None, help="a .jsonl / .json / .parquet file or folder; rows joined with the tokenizer's EOS")


def _text_column():
    return option("text", help="the text column of --dataset")


def check_text_column(text_column: str, dataset: str | None) -> None:
    """--text-column reads a --dataset's rows; with --text (no columns) it would be ignored: refused."""
    if text_column != "text" and dataset is None:
        raise GqakitError(f"{opt('text_column')} names a column of a {opt('dataset')}, and {opt('text')} has none; "
                          f"pass {opt('dataset', 'FILE.jsonl')} or drop {opt('text_column')}")


def _attention():
    return option(None, choices=attention_kinds.CHOICES,
                  help="gqakit attention kind via gqakit.attention.use",
                  default_text="the model's own")


def _window():
    return option(None, help="window of --attention sliding/sinks")


def _sinks():
    return option(None, help="sink tokens of --attention sinks", default_text=str(attention_kinds.DEFAULTS["sinks"]))


def _attention_option():
    return option((), metavar="NAME=VALUE",
                  help="any other option of the kind, e.g. stride=128 for --attention sparse (repeatable; see "
                       "docs/attention.md)")


def _kv_cache(what: str, without: str):
    """--kv-cache of `eval ppl | passkey | niah`: one cache vocabulary, checked once (`kvcache.check_options`)."""
    return option(None, choices=KV_CACHES,
                  help=f"feed {what} through transformers' KV cache, in --kv-chunk chunks: dense (DynamicCache), fp8 "
                       "(QuantizedCache, float8_e4m3fn), int4 / int2 (QuantizedCache with optimum-quanto, KIVI-style, "
                       "group 64, 128 recent tokens kept at full precision)",
                  default_text=f"none: {without}")


def _prompt_kv_cache():
    """--kv-cache of `eval passkey | niah`, whose prompts are prefilled and then decoded."""
    return _kv_cache("each prompt (prefilled, then decoded greedily)", "the prompt in one forward, a dense cache")


def _kv_chunk():
    return option(None, help="tokens per forward with --kv-cache; later tokens read the cached past",
                  default_text=str(DEFAULT_KV_CHUNK))


def _dtype():
    return option("float32", choices=dtypes.NAMES, help="compute dtype")


def _device():
    return option("auto", help="auto (CUDA when available), cpu, cuda, cuda:N")


def _tokenizer():
    return option(None, help="tokenizer folder", default_text="the model's own")


def _output():
    return option(None, flag="-o/--output", help="report folder",
                  default_text="runs/eval-<kind>-<YYYYmmdd-HHMMSS>, then -2, -3, ... if taken")


def _force():
    return option(False, help="replace an existing report folder")


def _allow_fitted_text():
    return option(False, help="score a text the model was calibrated or uptrained on (its gqakit-fitted.json "
                              "names it), refused otherwise: that score is not held out")


def _progress():
    return option(True, flag="-q/--quiet", invert=True, help="no progress bars")


@dataclasses.dataclass(frozen=True)
class PplConfig:
    """`gqakit eval ppl`: one or more models on the same text, one comparison table."""

    models: tuple[str, ...] = option(flag="MODEL", help="Hugging Face checkpoint folder(s)")
    text: str | None = _text()
    dataset: str | None = _dataset()
    text_column: str = _text_column()
    target_column: str | None = option(None, help="encoder-decoders with --dataset: score this column's text given "
                                                  "--text-column's as the encoder input, row by row",
                                           default_text="T5's span corruption of the text")
    max_tokens: int | None = option(None, help="score only the first N tokens of the text; 0 = the whole text",
                                    default_text="the whole text")
    max_length: int | None = option(None, help="window in model positions",
                                    default_text="1024, or the smallest model context if shorter")
    stride: int | None = option(None, help="window step in tokens; smaller = more context per token",
                                default_text="disjoint windows")
    bos: bool = option(False, help="prefix each window with BOS and score its first text token too")
    bootstrap: int = option(1000, help="resamples of windows for the 95%% bootstrap interval of the perplexity")
    seed: int = option(0, at_least=-SEED_MAX, at_most=SEED_MAX, help="seed of the bootstrap resampling")
    attention: str | None = _attention()
    window: int | None = _window()
    sinks: int | None = _sinks()
    attention_option: tuple[str, ...] = _attention_option()
    kv_cache: str | None = _kv_cache("each window", "one forward per window")
    kv_chunk: int | None = _kv_chunk()
    dtype: str = _dtype()
    device: str = _device()
    tokenizer: str | None = _tokenizer()
    allow_fitted_text: bool = _allow_fitted_text()
    output: str | None = _output()
    force: bool = _force()
    progress: bool = _progress()

    def __post_init__(self):
        check_fields(self)  # the declared bounds (--seed)


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    """`gqakit eval stream`: one model, one text, one or more cache policies compared position by position."""

    model: str = option(flag="MODEL", help="Hugging Face checkpoint folder")
    text: str | None = _text()
    dataset: str | None = _dataset()
    text_column: str = _text_column()
    tokens: int = option(4096, help="text tokens to stream; BOS, if asked for, comes on top")
    policies: tuple[str, ...] = option(("sinks",), flag="--policy", metavar="POLICY", parse=_policies, repeat=True,
                                       help="dense, window, sinks or recompute; repeat (or comma-separate) to "
                                            "compare")
    window: int = option(1020, remember=True, help="recent tokens W kept")
    sinks: int = option(4, remember=True, help="attention-sink tokens S of --policy sinks")
    chunk: int = option(256, help="tokens per forward C; per-token results do not depend on it, but recompute's R "
                                  "defaults to it")
    recompute_every: int | None = option(None, metavar="R", help="recompute: rebuild every R tokens; 1 = exact "
                                                                 "per-token baseline, slow", default_text="--chunk")
    bucket: int | None = option(None, help="positions per perplexity bucket", default_text="tokens/32")
    bos: bool = option(False, help="start the stream with BOS")
    fluent_within: float = option(0.10, help="fluent if the worst bucket is within this fraction of recompute")
    dtype: str = _dtype()
    device: str = _device()
    tokenizer: str | None = _tokenizer()
    allow_fitted_text: bool = _allow_fitted_text()
    output: str | None = _output()
    force: bool = _force()
    progress: bool = _progress()
    given: frozenset = frozenset()  # --window / --sinks typed on the command line, even at their default values

    def __post_init__(self):
        check_fields(self)  # the declared bounds (--seed)


@dataclasses.dataclass(frozen=True)
class PasskeyConfig:
    """`gqakit eval passkey`: accuracy per (prompt length, depth), as a table and a heatmap."""

    model: str = option(flag="MODEL", help="Hugging Face checkpoint folder")
    lengths: tuple[int, ...] = option((1024, 2048, 4096), parse=parse_lengths,
                                      help="prompt lengths in tokens, k = 1024")
    depths: tuple[float, ...] = option((0.0, 0.25, 0.5, 0.75, 1.0), parse=parse_depths,
                                       help="relative depths of the key, 0 = start, 1 = end")
    trials: int = option(5, help="prompts per (length, depth)")
    seed: int = option(0, at_least=-SEED_MAX, at_most=SEED_MAX, help="seed of the keys")
    new_tokens: int = option(10, help="tokens decoded greedily")
    attention: str | None = _attention()
    window: int | None = _window()
    sinks: int | None = _sinks()
    attention_option: tuple[str, ...] = _attention_option()
    kv_cache: str | None = _prompt_kv_cache()
    kv_chunk: int | None = _kv_chunk()
    dtype: str = _dtype()
    device: str = _device()
    tokenizer: str | None = _tokenizer()
    output: str | None = _output()
    force: bool = _force()
    progress: bool = _progress()

    def __post_init__(self):
        check_fields(self)  # the declared bounds (--seed)


@dataclasses.dataclass(frozen=True)
class NiahConfig:
    """`gqakit eval niah`: RULER-style synthetic retrieval, accuracy per (task, haystack, length, depth) of one or
    more models side by side (`evaluate/needles.py` generates the prompts)."""

    models: tuple[str, ...] = option(flag="MODEL", help="Hugging Face checkpoint folder(s), compared side by side")
    tasks: tuple[str, ...] = option(tuple(TASKS), parse=parse_tasks, help=f"task families: {', '.join(TASKS)}")
    haystacks: tuple[str, ...] = option(("filler",), flag="--haystack", metavar="HAYSTACK", parse=parse_haystacks,
                                        help="filler (repeated sentences) and/or text (the words of --haystack-text)")
    haystack_text: str | None = option(None, help="UTF-8 .txt file of the text haystack",
                                       default_text="gqakit/assets/pride_and_prejudice.txt")
    lengths: tuple[int, ...] = option((1024, 2048, 4096), parse=parse_lengths,
                                      help="prompt lengths in tokens, k = 1024; at most the model's context")
    depths: tuple[float, ...] = option((0.0, 0.5, 1.0), parse=parse_depths,
                                       help="relative depths of the asked needle, 0 = start, 1 = end")
    samples: int = option(10, help="prompts per (task, haystack, length, depth)")
    seed: int = option(0, at_least=-SEED_MAX, at_most=SEED_MAX, help="seed of the needles and the text offsets")
    new_tokens: int | None = option(None, help="tokens decoded greedily", default_text="12 for niah_*, 32 for vt")
    attention: str | None = _attention()
    window: int | None = _window()
    sinks: int | None = _sinks()
    attention_option: tuple[str, ...] = _attention_option()
    kv_cache: str | None = _prompt_kv_cache()
    kv_chunk: int | None = _kv_chunk()
    dtype: str = _dtype()
    device: str = _device()
    tokenizer: str | None = _tokenizer()
    output: str | None = _output()
    force: bool = _force()
    progress: bool = _progress()

    def __post_init__(self):
        check_fields(self)  # the declared bounds (--seed)

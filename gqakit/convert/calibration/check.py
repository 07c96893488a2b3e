"""The checks calibration text must pass, torch-free: the window, the text read, its token ids (within the model's
vocabulary, at least two windows); and the dry run's version of them.

A conversion tokenises with transformers' AutoTokenizer (`data.load_calibration`). `convert-gqa --dry-run`, which
loads neither torch nor transformers, counts with the `tokenizers` library on tokenizer.json where that is exactly
what transformers would run (`hf.tokenizer_json`), and so refuses what the run would refuse; where it is not, it
reads the text only and its plan says that the length and id checks run when converting.
"""
from __future__ import annotations

from pathlib import Path

from gqakit.common.errors import GqakitError, opt, renamed
from gqakit.hf.fields import context_length

DEFAULT_WINDOW = 512


def calibration_window(config: dict, tokens: int, window: int | None) -> int:
    """The calibration window (`window`, or min(512, the model's context)), checked against the context and the
    token budget (two windows at least: calibration fits on some and scores on others)."""
    context = context_length(config)
    window = (min(DEFAULT_WINDOW, context) if isinstance(context, int) and context > 0 else DEFAULT_WINDOW) \
        if window is None else window
    if window < 2:
        raise GqakitError(f"{opt('calibration_window', window)} is too short; use at least 2 tokens (default 512)")
    if isinstance(context, int) and window > context:
        raise GqakitError(f"{opt('calibration_window', window)} exceeds the model's {context}-token context "
                          f"(max_position_embeddings); use at most {context}")
    if tokens < 2 * window:
        raise GqakitError(f"{opt('calibration_tokens', f'{tokens:,}')} is less than two {window}-token windows; "
                          f"calibration fits on some windows and scores on others: use at least {2 * window:,}")
    return window


def heldout_count(windows: int) -> int:
    """Windows kept out of the statistics to score a merge: one in eight, at least one."""
    return max(1, windows // 8)


def read_calibration(path: str, text_column: str) -> list[str]:
    """The documents of --calibration DATA: a .txt file is one, JSON lines / JSON / parquet give one per row."""
    from gqakit.common.text import load_documents

    source = Path(path)
    if not source.exists():
        raise GqakitError(f"calibration data {path} does not exist; pass a local .txt file or a .jsonl / .json / "
                          ".parquet file or folder")
    is_text = source.is_file() and source.suffix.lower() == ".txt"
    with renamed({"text": "calibration", "dataset": "calibration"}):
        return load_documents(text=str(source) if is_text else None, dataset=None if is_text else str(source),
                              text_column=text_column)


def check_ids(path: str, model_dir: Path, ids: list[int], vocab, window: int) -> int:
    """Refuse ids outside the model's vocabulary or fewer than two windows; the number of whole windows."""
    if isinstance(vocab, int) and max(ids) >= vocab:
        raise GqakitError(f"calibration data {path} tokenizes to id {max(ids):,}, outside the model's vocabulary "
                          f"of {vocab:,} (vocab_size); the tokenizer in {model_dir} does not belong to these weights")
    if len(ids) // window < 2:
        raise GqakitError(f"calibration data {path} gives {len(ids):,} tokens, less than two {window}-token windows "
                          f"({2 * window:,} tokens); pass more text or a smaller --calibration-window")
    return len(ids) // window


def dry_run_check(path: str, model_dir: Path, config: dict, tokens: int, window: int | None,
                  text_column: str) -> str:
    """The checks a conversion makes on --calibration DATA, made without torch or transformers where they can be
    made exactly; the plan's line that says what was checked and what is left to the conversion."""
    from gqakit.common.text import document_ids, eos_id
    from gqakit.hf.tokenizer_json import plain_tokenizer

    window = calibration_window(config, tokens, window)
    documents = read_calibration(path, text_column)
    tokenizer = plain_tokenizer(model_dir, config)
    if isinstance(tokenizer, str):
        return (f"calibration: {path} read ({len(documents):,} document{'s' if len(documents) != 1 else ''}); its "
                f"length and token ids are checked when converting: {tokenizer}")
    try:
        ids = document_ids(documents, tokenizer.encode, eos_id(tokenizer) if len(documents) > 1 else None, tokens)
    except GqakitError as e:
        raise GqakitError(f"calibration data {path}: {e}") from None
    windows = check_ids(path, model_dir, ids, config.get("vocab_size"), window)
    return (f"calibration: {windows:,} windows of {window:,} tokens from {path} ({heldout_count(windows):,} held out), "
            "counted with tokenizer.json as transformers counts")

"""Evaluation text: a local .txt file, or JSON lines / JSON / parquet rows read with `datasets`.

A .txt file is one document. JSON lines, JSON and parquet give one document per row (the `text`
column unless told otherwise); documents are tokenized one by one, without special tokens, and
joined with the tokenizer's EOS token id (joining ids, not strings, so that a literal "<|endoftext|>"
in the text is never mistaken for the separator). BOS handling is the evaluator's business.

Every problem a user can cause is a one-line `GqakitError` that names the fix.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from gqakit.common.errors import GqakitError, opt

if TYPE_CHECKING:  # torch only in annotations: reading documents needs none
    import torch

ROW_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _suffix(path: Path) -> str:
    return path.suffix.lower()


def _row_files(path: Path) -> tuple[str, list[str]]:
    """(datasets builder name, data files) of a row file or of a folder of row files of one format."""
    if path.is_file():
        builder = ROW_SUFFIXES.get(_suffix(path))
        if builder is None:
            raise GqakitError(f"{path}: unknown data format {path.suffix or '(no suffix)'!r}; use .txt "
                              f"({opt('text')}), or .jsonl / .json / .parquet ({opt('dataset')})")
        return builder, [str(path)]
    files = sorted(p for p in path.iterdir() if p.is_file() and _suffix(p) in ROW_SUFFIXES)
    builders = {ROW_SUFFIXES[_suffix(p)] for p in files}
    if not files:
        raise GqakitError(f"dataset folder {path} holds no .jsonl, .json or .parquet file; "
                          f"point {opt('dataset')} at such a file or folder")
    if len(builders) > 1:
        raise GqakitError(f"dataset folder {path} mixes JSON and parquet files; keep one format per folder")
    return builders.pop(), [str(p) for p in files]


def load_rows(path: str | Path, text_column: str = "text") -> list[str]:
    """The `text_column` strings of a JSON lines / JSON / parquet file (or folder of them), in order."""
    return [row[0] for row in load_columns(path, (text_column,))]


def null_rows(values, where: str, column: str, first_row: int = 0) -> list[int]:
    """The rows (counted from 1, `first_row` rows before these) whose `column` is missing or null, which the caller
    skips and says so (`skipped_note`); a value of another type (a number, a list) is refused, naming the row: the
    column is likely not the text, and dropped it would change what is scored or trained without a word."""
    missing = []
    for i, value in enumerate(values):
        if value is None:
            missing.append(first_row + i + 1)
        elif not isinstance(value, str):
            raise GqakitError(f"{where}: row {first_row + i + 1} has the {type(value).__name__} {str(value)[:40]!r} "
                              f"in column {column!r}, not text; fix that row, or name the text column")
    return missing


def skipped_note(where: str, column: str, rows: list[int]) -> None:
    """One stderr line for the rows `null_rows` found (`column` as the line names it: 'text', or 'text' or
    'target' for pairs), so that skipping them is never silent."""
    if rows:
        print(f"note: {where}: skipped {len(rows):,} row{'s' if len(rows) > 1 else ''} with no {column} (missing "
              f"or null), the first row {rows[0]:,}", file=sys.stderr)


def load_columns(path: str | Path, columns: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The rows of a JSON lines / JSON / parquet file (or folder of them) whose `columns` all hold non-empty text,
    as tuples in the order of `columns` (the first is the --text-column the errors name)."""
    path = Path(path)
    if not path.exists():
        raise GqakitError(f"dataset {path} does not exist; pass a local .jsonl, .json or .parquet file or folder")
    builder, files = _row_files(path)
    import datasets

    datasets.disable_progress_bars()
    try:
        table = datasets.load_dataset(builder, data_files=files, split="train")
    except Exception as e:  # malformed JSON, a non-parquet file named .parquet, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GqakitError(f"cannot read {path} as {builder}: {first}; check the file") from None
    flags = ("text_column", "target_column")
    for column, flag in zip(columns, flags):
        if column not in table.column_names:
            raise GqakitError(f"{path} has no column {column!r} (columns: {', '.join(table.column_names)}); "
                              f"pass {opt(flag, 'NAME')}")
    skipped = sorted({row for column in columns for row in null_rows(table[column], str(path), column)})
    skipped_note(str(path), " or ".join(repr(c) for c in columns), skipped)
    rows = [r for r in zip(*(table[c] for c in columns)) if all(x is not None and x.strip() for x in r)]
    if not rows:
        named = " and ".join(repr(c) for c in columns)
        raise GqakitError(f"{path}: no row holds non-empty text in {named}; check the file or "
                          f"{opt(flags[len(columns) - 1])}")
    return rows


def load_text_file(path: str | Path) -> list[str]:
    """A UTF-8 .txt file as one document (a one-element list)."""
    path = Path(path)
    if path.is_dir():
        raise GqakitError(f"{path} is a folder; pass a UTF-8 .txt file with {opt('text')} (a folder of rows with "
                          f"{opt('dataset')})")
    if not path.is_file():
        raise GqakitError(f"text file {path} does not exist; pass a UTF-8 .txt file with {opt('text')}")
    if _suffix(path) in ROW_SUFFIXES:
        raise GqakitError(f"{path} is {path.suffix} rows, not plain text; pass it with {opt('dataset')} instead of "
                          f"{opt('text')}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise GqakitError(f"{path} is not UTF-8 text (byte {e.start}); convert it to UTF-8") from None
    if not text.strip():
        raise GqakitError(f"text file {path} is empty; pass a file with some text")
    return [text]


def load_documents(text: str | None = None, dataset: str | None = None, text_column: str = "text") -> list[str]:
    """Documents from exactly one of `text` (a .txt file) or `dataset` (JSON lines / JSON / parquet)."""
    if (text is None) == (dataset is None):
        raise GqakitError(f"give exactly one of {opt('text', 'FILE.txt')} or "
                          f"{opt('dataset', 'FILE.jsonl|FILE.parquet|FOLDER')}")
    return load_text_file(text) if text is not None else load_rows(dataset, text_column)


def eos_id(tokenizer) -> int:
    """The tokenizer's EOS id (the document separator); a clear error when it has none."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise GqakitError(f"the tokenizer ({type(tokenizer).__name__}) has no EOS token to join documents with; "
                          "use a single .txt document or a tokenizer with eos_token set")
    return int(eos)


def document_ids(documents: list[str], encode: Callable[[str], list[int]], separator: int | None,
                 max_tokens: int | None = None) -> list[int]:
    """Token ids of the documents, each encoded by `encode` (no special tokens), joined with `separator` (the EOS id,
    `eos_id`; needed only for several documents), cut to `max_tokens`. Torch-free."""
    ids: list[int] = []
    for i, doc in enumerate(documents):
        if i:
            ids.append(separator)
        ids.extend(encode(doc))
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    if not ids:
        raise GqakitError("the evaluation text tokenizes to no tokens; pass a longer text")
    return ids if max_tokens is None else ids[:max_tokens]


def encode_documents(documents: list[str], tokenizer, max_tokens: int | None = None) -> torch.Tensor:
    """1-D token ids of the documents joined with EOS (no special tokens added), cut to `max_tokens`."""
    import torch

    separator = eos_id(tokenizer) if len(documents) > 1 else None
    ids = document_ids(documents, lambda doc: tokenizer(doc, add_special_tokens=False, verbose=False).input_ids,
                       separator, max_tokens)
    return torch.tensor(ids, dtype=torch.long)

"""Training data sources, read as a stream of text pieces with bounded memory.

A data entry is one of:
  FILE.txt                  one document, read in ~1 MB chunks split at blank lines (see `text_chunks`)
  FILE.jsonl/.json/.parquet one document per row (the `text_column`; empty rows are skipped), streamed
  FOLDER                    of such row files (one format), or a `datasets` `save_to_disk` folder, or a
                            token cache made by `gqakit tokenize` (used as it is, see `token_cache`)
  hf:NAME                   a Hugging Face hub dataset's train split, streamed (needs the network)

`iter_pieces` yields (texts, ends) batches: `ends[i]` says whether texts[i] is the last piece of its
document, i.e. whether EOS follows it in the token stream. Rows are whole documents; a .txt file gives
several pieces of which only the last ends the document, tokenised separately and joined without EOS
(so a big file is tokenised in parallel and in bounded memory).

The cost of cutting a .txt file: a BPE merge never crosses a cut. Cuts are placed so that GPT-2-style
byte-level pre-tokenisers (GPT-2, the embedded tokenizer) split both sides exactly as they split the
whole file, and the pieces then tokenise to the same ids (tested). Tokenizers whose pre-tokeniser glues
a newline run to the punctuation before it (Llama 3, Qwen2) or that add a prefix space to every input
(SentencePiece) may give a token or two differently at each cut, about once per `chunk_bytes` of text.
Either way the pieces are a function of the file and `chunk_bytes` alone: the stream is the same for
any number of workers.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

from gqakit.common.text import ROW_SUFFIXES, null_rows, skipped_note
from gqakit.common.errors import GqakitError
from gqakit.uptrain.data.token_cache import is_token_cache

HUB = "hf:"
CHUNK_BYTES = 1 << 20  # target size of a .txt piece
ROWS_PER_BATCH = 1000
JSON_CHUNK_BYTES = 2 << 20  # JSON lines parsed per block (datasets' default of 10 MB costs ~80 MB more RSS)
_BLANK_LINE = re.compile(rb"\n[ \t\r\f\v]*\n")
_SPACE = frozenset(b" \t\r\n\f\v")
_RUN_SLACK = 1 << 16  # bytes read past the search window, so that a whitespace run can be seen whole


@dataclasses.dataclass(frozen=True)
class Source:
    entry: str  # as the user wrote it
    kind: str  # text | rows | saved | hub | cache
    path: Path | None = None
    files: tuple[Path, ...] = ()  # the files whose (size, mtime, sampled bytes) identify the content
    builder: str | None = None  # json | parquet, for rows


def _row_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in ROW_SUFFIXES)


def folder_kind(path: Path) -> str | None:
    """cache | saved | rows for a folder gqakit can read, else None."""
    if is_token_cache(path):
        return "cache"
    if (path / "dataset_dict.json").is_file() or ((path / "state.json").is_file()
                                                  and (path / "dataset_info.json").is_file()):
        return "saved"
    return "rows" if _row_files(path) else None


def resolve_source(entry: str) -> Source:
    """What a data entry is; a one-line error for one gqakit cannot read."""
    if entry.startswith(HUB):
        return Source(entry, "hub")
    path = Path(entry).expanduser()
    if not path.exists():
        raise GqakitError(f"data path {entry} does not exist; pass a .txt/.jsonl/.json/.parquet file, a folder of "
                          "them, a save_to_disk folder, a token cache, or hf:NAME")
    if path.is_dir():
        kind = folder_kind(path)
        if kind is None:
            raise GqakitError(f"data folder {entry} holds no .jsonl/.json/.parquet file, no token cache (header.json) "
                              "and no datasets save_to_disk dataset; point at one of those")
        if kind == "rows":
            files = _row_files(path)
            unread = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir()
                            if (p.is_file() and p.suffix.lower() == ".txt") or (p.is_dir() and any(
                                q.suffix.lower() in (*ROW_SUFFIXES, ".txt") for q in p.rglob("*") if q.is_file())))
            if unread:
                more = " ..." if len(unread) > 3 else ""
                raise GqakitError(f"data folder {entry} holds {', '.join(unread[:3])}{more} beside its .jsonl/.json/"
                                  ".parquet rows, and a rows folder reads only its own row files; list those as data "
                                  "entries of their own")
            builders = {ROW_SUFFIXES[p.suffix.lower()] for p in files}
            if len(builders) > 1:
                raise GqakitError(f"data folder {entry} mixes JSON and parquet files; keep one format per folder")
            return Source(entry, kind, path, tuple(files), builders.pop())
        files = tuple(sorted(p for p in path.rglob("*") if p.is_file())) if kind == "saved" else ()
        return Source(entry, kind, path, files)
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return Source(entry, "text", path, (path,))
    if suffix in ROW_SUFFIXES:
        return Source(entry, "rows", path, (path,), ROW_SUFFIXES[suffix])
    raise GqakitError(f"data file {entry} is neither .txt nor .jsonl/.json/.parquet; convert it or list another file")


def refuse_unread_text_column(sources: list[Source], given: str, drop: str) -> None:
    """A text column given (`given`, as the user spelled it) for data that have no columns (.txt files, token
    caches) would be read nowhere: refused, naming what to `drop`."""
    if not any(source.kind in ("rows", "saved", "hub") for source in sources):
        what = " and ".join(sorted({"token caches" if s.kind == "cache" else ".txt files" for s in sources}))
        raise GqakitError(f"{given} names a column of .jsonl / .json / .parquet data or a dataset, and the data are "
                          f"{what}; drop {drop}")


def describe_files(sources: list[Source]) -> list[dict]:
    """(path, size, mtime_ns, sample) of every file behind the sources: what a cache of them must match. The sample
    (a hash of the first and last `SAMPLE_BYTES`) tells a rewrite that kept size and mtime (cp -p, tar x, images with
    fixed timestamps) from the same bytes copied again (rsync -a staging, which a change time would not)."""
    out = []
    for source in sources:
        if source.kind == "hub":
            out.append({"path": source.entry, "size": None, "mtime_ns": None})
        for f in source.files:
            stat = f.stat()
            out.append({"path": str(f.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                        "sample": sample_digest(f, stat.st_size)})
    return out


SAMPLE_BYTES = 1 << 16


def sample_digest(path: Path, size: int) -> str:
    """blake2b of a file's first and last SAMPLE_BYTES (all of a smaller file)."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        digest.update(f.read(SAMPLE_BYTES))
        if size > 2 * SAMPLE_BYTES:
            f.seek(size - SAMPLE_BYTES)
        digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def _cut(buf: bytes, chunk_bytes: int, final: bool) -> int:
    """Where the piece starting at buf[0] ends: the first blank line at or after `chunk_bytes` (else a
    line break, else the last space, else a character boundary) before 4 * chunk_bytes. The cut is placed
    before the last whitespace byte of the run, so the next piece starts with "\\nText" (or " text"):
    GPT-2-style pre-tokenisers then split both sides exactly as they split the whole file."""
    if final and len(buf) <= chunk_bytes:
        return len(buf)
    hi = min(len(buf), 4 * chunk_bytes)
    match = _BLANK_LINE.search(buf, chunk_bytes, hi)
    newline = match.start() if match else buf.find(b"\n", chunk_bytes, hi)
    if newline >= 0:
        end = newline + 1
        while end < len(buf) and buf[end] in _SPACE:
            end += 1
        if end == len(buf) and final:
            return len(buf)  # trailing whitespace: the rest of the file is the last piece
        return end - 1
    if final and len(buf) <= 4 * chunk_bytes:
        return len(buf)
    space = max(buf.rfind(b" ", chunk_bytes, hi), buf.rfind(b"\t", chunk_bytes, hi))
    if space > chunk_bytes:  # no line break in reach: before the last space of a run, as for line breaks
        while space + 1 < hi and buf[space + 1] in _SPACE:
            space += 1
        return space
    cut = hi
    while cut > chunk_bytes and buf[cut] & 0xC0 == 0x80:  # not inside a UTF-8 character
        cut -= 1
    return cut


def text_chunks(path: Path, chunk_bytes: int = CHUNK_BYTES) -> Iterator[str]:
    """A UTF-8 text file in pieces of about `chunk_bytes` (at most 4x), cut as `_cut` says. The pieces
    depend only on the file and `chunk_bytes`, never on how it is read or how many workers tokenise. Line
    ends are read as Python's text mode reads them (\r\n and \r become \n), as `gqakit eval ppl` and the
    converter read a .txt file, so training and evaluation tokenise the same text."""
    want = 4 * chunk_bytes + _RUN_SLACK
    offset, buf, final, blank, held = 0, b"", False, True, b""
    with open(path, "rb") as f:
        while buf or not final:
            if not final and len(buf) < want:
                block = f.read(want - len(buf))
                final = len(block) < want - len(buf)
                block, held = held + block, b""
                if block.endswith(b"\r") and not final:  # its \n may come with the next read
                    block, held = block[:-1], b"\r"
                buf += block.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
                continue
            cut = _cut(buf, chunk_bytes, final)
            try:
                text = buf[:cut].decode("utf-8")
            except UnicodeDecodeError as e:
                raise GqakitError(f"{path} is not UTF-8 text (byte {offset + e.start}, counting a \\r\\n as one); "
                                  "convert it to UTF-8") from None
            blank = blank and not text.strip()
            yield text
            offset, buf = offset + cut, buf[cut:]
    if blank:
        raise GqakitError(f"text file {path} is empty; pass a file with some text")


def _column_error(where: str, column: str, columns) -> GqakitError:
    return GqakitError(f"{where} has no column {column!r} (columns: {', '.join(columns)}); name the text column "
                       "(gqakit tokenize --text-column NAME, or text_column: NAME in the recipe)")


def _rows(open_batches, where: str, column: str) -> Iterator[tuple[list[str], list[bool]]]:
    """Non-empty strings of `column` from `open_batches()`, an iterator of column dicts, as (texts, ends)
    batches; any failure to read is a one-line error."""
    found, seen, skipped = False, 0, []
    try:
        for batch in open_batches():
            if column not in batch:
                raise _column_error(where, column, batch)
            skipped += null_rows(batch[column], where, column, seen)
            seen += len(batch[column])
            texts = [t for t in batch[column] if t is not None and t.strip()]
            found = found or bool(texts)
            if texts:
                yield texts, [True] * len(texts)
    except GqakitError:
        raise
    except Exception as e:  # malformed JSON, a non-parquet file named .parquet, no network, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GqakitError(f"cannot read {where}: {first}; check the data") from None
    if not found:
        raise GqakitError(f"{where}: column {column!r} holds no non-empty text; check the data or the text column")
    skipped_note(where, repr(column), skipped)


def iter_pieces(source: Source, text_column: str = "text", chunk_bytes: int = CHUNK_BYTES
                ) -> Iterator[tuple[list[str], list[bool]]]:
    """The source as (texts, ends) batches, in order (module docstring)."""
    import datasets

    if source.kind == "text":
        pieces = text_chunks(source.path, chunk_bytes)
        piece = next(pieces)
        for following in pieces:
            yield [piece], [False]
            piece = following
        yield [piece], [True]
    elif source.kind == "rows":
        files = [str(f) for f in source.files]
        options = {"chunksize": JSON_CHUNK_BYTES} if source.builder == "json" else {}
        yield from _rows(lambda: datasets.load_dataset(source.builder, data_files=files, split="train", streaming=True,
                                                       **options).iter(batch_size=ROWS_PER_BATCH),
                         f"{source.entry} as {source.builder}", text_column)
    elif source.kind == "saved":
        table = datasets.load_from_disk(str(source.path))
        if isinstance(table, datasets.DatasetDict):
            raise GqakitError(f"{source.entry} holds a DatasetDict with splits {', '.join(table)}; point at one "
                              f"split's folder, e.g. {os.path.join(source.entry, next(iter(table)))}")
        if text_column not in table.column_names:
            raise _column_error(source.entry, text_column, table.column_names)
        yield from _rows(lambda: table.select_columns([text_column]).iter(batch_size=ROWS_PER_BATCH), source.entry,
                         text_column)
    elif source.kind == "hub":
        # needs the network; tokenize it once (gqakit tokenize hf:NAME -o TOKENS) to train offline
        name = source.entry[len(HUB):]
        yield from _rows(lambda: datasets.load_dataset(name, split="train", streaming=True).iter(
            batch_size=ROWS_PER_BATCH), f"hub dataset {name}", text_column)
    else:
        raise ValueError(f"{source.entry} is a {source.kind}, not text to tokenise")

"""Tokenising data into a token cache (format: `token_cache`), with memory that does not grow with the corpus.

    gqakit tokenize corpus/ books.txt -o tokens/ --tokenizer MODEL --num-proc 8

The sources are read in order as pieces (`sources.iter_pieces`: rows, or ~1 MB chunks of a .txt file)
into an Arrow file of at most `segment_bytes` of text; each segment is tokenised with
`datasets.Dataset.map(batched=True, num_proc=N)` (contiguous shards, so the order is kept) and its ids
are appended to tokens.bin batch by batch, with EOS after each document's last piece; then the segment's
files are deleted and the next one starts. Memory is a few batches; temporary disk is about two
segments, inside the temporary folder the cache is built in, which is renamed into place at the end
(a failed or interrupted build leaves nothing behind). The stream is the same for any `num_proc`.

The implicit cache of `gqakit uptrain` lives under a cache root (recipe `cache_dir`, else the
GQAKIT_CACHE_DIR environment variable, else ~/.cache/gqakit/tokens) in a folder named by a hash of the
data paths, the tokenizer fingerprint, the text column, the chunk size and the format version. Sizes
and modification times are not in the name but in the header: data edited in place makes the cache
stale, and it is rebuilt in the same folder (with a notice) instead of leaving the old copy behind, and
caches of data that no longer exists (scratch folders) are deleted whenever a cache is built. A file
lock makes concurrent runs on the same data build it once.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

import numpy as np

from gqakit import __version__
from gqakit.common import file_locks, fitted
from gqakit.common.atomic import atomic_output, check_replaceable, inside
from gqakit.common.report import counted
from gqakit.common.errors import GqakitError, opt
from gqakit.common.text import eos_id
from gqakit.uptrain.data.sources import (CHUNK_BYTES, HUB, ROWS_PER_BATCH, Source, describe_files, iter_pieces,
                                         refuse_unread_text_column, resolve_source)
from gqakit.uptrain.data.token_cache import (DOCUMENTS, FORMAT, HEADER, TOKENS, VERSION, CacheProblem, is_token_cache,
                                             open_cache, refuse_repeated_texts, token_dtype,
                                             tokenizer_fingerprint)

SEGMENT_BYTES = 32 << 20  # text tokenised per datasets.map call (one worker pool each)
BATCH_BYTES = 1 << 20  # text per map batch and per Arrow record batch: a tokenizer call's memory scales with it
DEFAULT_ROOT = "~/.cache/gqakit/tokens"


def _notice(message: str) -> None:
    print(f"gqakit: {message}", file=sys.stderr, flush=True)


def load_tokenizer(name: str):
    """AutoTokenizer.from_pretrained(name), with a one-line error when there is none to load."""
    from transformers import AutoTokenizer

    from gqakit.hf.hub import tokenizer_files_only

    local_only = tokenizer_files_only(name)
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=local_only)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GqakitError(f"cannot load a tokenizer from {name} ({first}); pass a model folder that holds "
                          "tokenizer files") from None


def _tokenize_batch(batch: dict, tokenizer) -> dict:
    encoded = tokenizer(batch["text"], add_special_tokens=False, verbose=False, return_attention_mask=False,
                        return_token_type_ids=False)
    return {"ids": encoded.input_ids}


@contextlib.contextmanager
def _datasets_quiet():
    """No datasets progress bars inside (we draw one bar for the whole build); the setting is restored."""
    import datasets

    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if enabled:
            datasets.enable_progress_bars()


class _Segment:
    """Pieces written to an Arrow stream file in record batches of about BATCH_BYTES."""

    def __init__(self, path: Path):
        import pyarrow as pa

        self.path, self.rows, self.chars = path, 0, 0
        self._schema = pa.schema([("text", pa.string()), ("end", pa.bool_())])
        self._writer = pa.ipc.new_stream(str(path), self._schema)
        self._texts: list[str] = []
        self._ends: list[bool] = []
        self._pending = 0

    def add(self, texts: list[str], ends: list[bool]) -> None:
        self._texts += texts
        self._ends += ends
        size = sum(map(len, texts))
        self._pending += size
        self.rows, self.chars = self.rows + len(texts), self.chars + size
        if self._pending >= BATCH_BYTES or len(self._texts) >= ROWS_PER_BATCH:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if self._texts:
            self._writer.write_batch(pa.record_batch([pa.array(self._texts, pa.string()), pa.array(self._ends)],
                                                     schema=self._schema))
        self._texts, self._ends, self._pending = [], [], 0

    def close(self) -> None:
        self._flush()
        self._writer.close()


class _StreamWriter:
    """Appends tokenised pieces to tokens.bin (EOS after each document) and boundaries to documents.bin,
    hashing both as they are written."""

    def __init__(self, folder: Path, dtype: np.dtype, eos: int):
        self.dtype, self.eos, self.tokens, self.documents = dtype, eos, 0, 0
        self._files = {TOKENS: open(folder / TOKENS, "wb"), DOCUMENTS: open(folder / DOCUMENTS, "wb")}
        self._hashes = {name: hashlib.blake2b(digest_size=16) for name in self._files}
        self._put(DOCUMENTS, np.zeros(1, dtype="<i8"))

    def _put(self, name: str, array: np.ndarray) -> None:
        data = array.tobytes()
        self._files[name].write(data)
        self._hashes[name].update(data)

    def write(self, batch) -> None:
        """One Arrow record batch of (end, ids) rows."""
        ids = batch.column("ids")
        values = ids.flatten().to_numpy(zero_copy_only=False).astype(self.dtype, copy=False)
        lengths = ids.value_lengths().to_numpy(zero_copy_only=False)
        ends = batch.column("end").to_numpy(zero_copy_only=False).astype(bool)
        cut = np.cumsum(lengths, dtype=np.int64)[ends]  # EOS goes after each document's last piece
        self._put(TOKENS, np.insert(values, cut, self.eos).astype(self.dtype, copy=False))
        self._put(DOCUMENTS, (self.tokens + cut + np.arange(1, len(cut) + 1)).astype("<i8"))
        self.tokens += len(values) + len(cut)
        self.documents += len(cut)

    def close(self) -> dict:
        for f in self._files.values():
            f.close()
        return {name: h.hexdigest() for name, h in self._hashes.items()}


def _record_batches(dataset):
    """A map result's record batches, read from its Arrow files with plain reads (a memory map would
    count every page read towards this process's resident memory)."""
    import pyarrow as pa

    files = [f["filename"] for f in dataset.cache_files]
    if not files:
        yield from dataset.data.to_batches()
        return
    for name in files:
        with pa.OSFile(name) as source:
            yield from pa.ipc.open_stream(source)


def _tokenize_segment(segment: _Segment, work: Path, tokenizer, dtype: np.dtype, num_proc: int, writer: _StreamWriter):
    import datasets

    pieces = datasets.Dataset.from_file(str(segment.path))
    rows_per_batch = max(1, min(ROWS_PER_BATCH, BATCH_BYTES * segment.rows // max(1, segment.chars)))
    procs = min(num_proc, len(pieces))
    features = datasets.Features({"end": datasets.Value("bool"), "ids": datasets.List(datasets.Value(dtype.name))})
    ids = pieces.map(_tokenize_batch, fn_kwargs={"tokenizer": tokenizer}, batched=True, batch_size=rows_per_batch,
                     writer_batch_size=rows_per_batch, num_proc=procs if procs > 1 else None,
                     remove_columns=["text"], features=features, cache_file_name=str(work / "ids.arrow"),
                     load_from_cache_file=False, new_fingerprint=uuid.uuid4().hex)
    for batch in _record_batches(ids):
        writer.write(batch)
    del pieces, ids
    for f in work.iterdir():
        f.unlink()


def build_cache(sources: list[Source], folder: str | Path, tokenizer, *, text_column: str = "text", num_proc: int = 1,
                chunk_bytes: int = CHUNK_BYTES, segment_bytes: int = SEGMENT_BYTES, progress: bool = False) -> dict:
    """Tokenise `sources` into the token cache `folder` (replacing it); returns its header."""
    from tqdm.auto import tqdm

    folder = Path(folder).absolute()
    t0 = time.perf_counter()
    eos, dtype = eos_id(tokenizer), token_dtype(len(tokenizer))
    files = describe_files(sources)  # before reading: an edit made while we read shows as stale later
    with atomic_output(folder, force=True) as tmp:  # a failed build leaves nothing; a rebuild replaces
        (tmp / "work").mkdir()
        writer = _StreamWriter(tmp, dtype, eos)
        try:
            with _datasets_quiet(), tqdm(unit="tok", unit_scale=True, desc="tokenize", disable=not progress) as bar:
                segment = None
                for source in sources:
                    for texts, ends in iter_pieces(source, text_column, chunk_bytes):
                        segment = segment or _Segment(tmp / "work" / "pieces.arrow")
                        segment.add(texts, ends)
                        if segment.chars >= segment_bytes:
                            segment.close()
                            _tokenize_segment(segment, tmp / "work", tokenizer, dtype, num_proc, writer)
                            bar.update(writer.tokens - bar.n)
                            segment = None
                if segment is not None:
                    segment.close()
                    _tokenize_segment(segment, tmp / "work", tokenizer, dtype, num_proc, writer)
                    bar.update(writer.tokens - bar.n)
            checksums = writer.close()
        except BaseException:
            writer.close()
            raise
        if not writer.tokens:
            raise GqakitError(f"{', '.join(s.entry for s in sources) or 'the data'} holds no text; add data")
        (tmp / "work").rmdir()
        header = {
            "format": FORMAT, "version": VERSION, "dtype": dtype.str, "tokens": writer.tokens,
            "documents": writer.documents, "eos_token_id": eos, "vocab_size": len(tokenizer),
            "tokenizer": {"name": str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__),
                          "fingerprint": tokenizer_fingerprint(tokenizer)},
            "text_column": text_column, "chunk_bytes": chunk_bytes, "entries": [s.entry for s in sources],
            "sources": files, "checksums": checksums, "gqakit": __version__,
            # the record of fitted texts a model uptrained on this cache keeps (`common.fitted`), digested now: the
            # sources may be gone when the cache is used elsewhere
            "fitted": fitted.entries([f["path"] for f in files if f["size"] is not None], "uptraining"),
            "seconds": round(time.perf_counter() - t0, 2),
        }
        (tmp / HEADER).write_text(json.dumps(header, indent=1))  # last: a folder with a header is complete
    return header


def tokenize_to(data: list[str], output: str | Path, tokenizer: str, *, num_proc: int = 1, text_column: str = "text",
                force: bool = False, progress: bool = True, chunk_bytes: int = CHUNK_BYTES) -> dict:
    """`gqakit tokenize`: tokenise `data` with the tokenizer of model folder `tokenizer` into the token
    cache `output`; returns its header. An existing `output` is replaced only with `force`, and only when
    it is a token cache (or an empty folder)."""
    out = Path(output)
    if num_proc < 1:
        raise GqakitError(f"{opt('num_proc', num_proc)} must be at least 1")
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        if not is_token_cache(out):
            raise GqakitError(f"{out} exists and is not a gqakit token cache; choose another -o ({opt('force')} only "
                              "replaces token caches)")
        if not force:
            raise GqakitError(f"{out} already holds a token cache; pass {opt('force')} to replace it, or choose "
                              "another -o")
        check_replaceable(out)  # a token cache a user has since added files to stays
    if Path(tokenizer).is_dir() and (inside(out, Path(tokenizer)) or inside(Path(tokenizer), out)):
        raise GqakitError(f"-o {out} overlaps the tokenizer folder {tokenizer}; choose an -o outside it")
    sources = [resolve_source(entry) for entry in data]
    # a cache's last documents are what uptrain holds out when it has no eval_data: a repeat would be trained on too
    refuse_repeated_texts(data, "list each text once (to weigh a text twice, list it twice in the recipe's data, "
                                "beside eval_data of its own)")
    for source in sources:
        if source.kind == "cache":
            raise GqakitError(f"{source.entry} is already a token cache; list it in the recipe's data instead")
        if source.path is not None and (inside(source.path, out) or inside(out, source.path)):
            raise GqakitError(f"-o {out} overlaps the data path {source.entry}; choose an -o outside the data")
    if text_column != "text":
        refuse_unread_text_column(sources, opt("text_column", text_column), opt("text_column"))
    return build_cache(sources, out, load_tokenizer(tokenizer), text_column=text_column, num_proc=num_proc,
                       chunk_bytes=chunk_bytes, progress=progress)


def cache_root(cache_dir: str | None = None) -> Path:
    """Where implicit caches live: `cache_dir`, else $GQAKIT_CACHE_DIR, else ~/.cache/gqakit/tokens."""
    return Path(cache_dir or os.environ.get("GQAKIT_CACHE_DIR") or DEFAULT_ROOT).expanduser()


def implicit_cache_path(sources: list[Source], fingerprint: str, root: Path, text_column: str = "text",
                        chunk_bytes: int = CHUNK_BYTES) -> Path:
    """The implicit cache folder of these sources (see the module docstring for what names it)."""
    key = {"version": VERSION, "text_column": text_column, "chunk_bytes": chunk_bytes, "tokenizer": fingerprint,
           "entries": [str(s.path.resolve()) if s.path is not None else s.entry for s in sources]}
    return root / hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=10).hexdigest()


@contextlib.contextmanager
def _locked(path: Path, wait: bool = True):
    """An exclusive advisory lock on `path` (no-op where fcntl is missing). With `wait=False` it yields False at
    once when another process holds the lock (and True when this one got it)."""
    try:
        import fcntl
    except ImportError:
        yield True
        return
    with open(path, "a") as f:
        file_locks.hold(f.fileno())  # forked tokenising workers do not keep it (their parent may die first)
        try:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
        finally:
            file_locks.release(f.fileno())


def _unusable(files: list[dict]) -> bool:
    """Whether a cache of these source files can never be used again: every file sits in a folder that is here
    (so the drive is mounted) and is gone or has changed since it was tokenised. A hub source, or a file whose
    folder is missing (an unmounted drive, a moved tree), keeps the cache."""
    if not files:
        return False
    for f in files:
        if f["path"].startswith(HUB) or not Path(f["path"]).parent.is_dir():
            return False
        try:
            stat = os.stat(f["path"])
        except FileNotFoundError:
            continue  # deleted data
        if (stat.st_size, stat.st_mtime_ns) == (f.get("size"), f.get("mtime_ns")):
            return False  # this source is as it was: the cache may serve it again
    return True


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def prune_orphans(root: Path, keep: Path) -> list[tuple[Path, int]]:
    """Delete the implicit caches under `root` (other than `keep`) that nothing can use again (`_unusable`:
    caches of scratch data would otherwise pile up), each only while holding its own lock, so a run that is
    using or building one is never pulled from under it. Returns (folder, bytes freed) of each removed."""
    removed = []
    for folder in sorted(root.iterdir()):
        if folder == keep or folder.name.startswith(".") or not is_token_cache(folder):
            continue
        with _locked(root / f"{folder.name}.lock", wait=False) as mine:
            if not mine or not is_token_cache(folder):
                continue
            if _unusable(json.loads((folder / HEADER).read_text()).get("sources", [])):
                freed = _size(folder)
                shutil.rmtree(folder, ignore_errors=True)
                Path(f"{folder}.lock").unlink(missing_ok=True)  # nothing can want this cache again
                removed.append((folder, freed))
    return removed


def ensure_cache(sources: list[Source], tokenizer, *, root: Path, text_column: str = "text", num_proc: int = 1,
                 chunk_bytes: int = CHUNK_BYTES, progress: bool = False, notice=_notice) -> Path:
    """The implicit cache of `sources`, checked (sources, tokenizer, checksums) or (re)built; its folder.
    Call it on one process; the others open the folder (`implicit_cache_path`) once it returns."""
    fingerprint = tokenizer_fingerprint(tokenizer)
    folder = implicit_cache_path(sources, fingerprint, root, text_column, chunk_bytes)
    made = [p for p in (root, *root.parents) if not p.exists()]  # folders this call creates
    root.mkdir(parents=True, exist_ok=True)
    lock = root / f"{folder.name}.lock"
    try:
        with _locked(lock):
            if folder.exists():
                try:
                    open_cache(folder, fingerprint=fingerprint, sources=describe_files(sources), verify=True,
                               progress=progress)
                    return folder
                except CacheProblem as e:
                    notice(f"the token cache {folder} {e.reason}; rebuilding it")
            try:
                header = build_cache(sources, folder, tokenizer, text_column=text_column, num_proc=num_proc,
                                     chunk_bytes=chunk_bytes, progress=progress)
            except BaseException:
                if not folder.exists():  # a failed first build leaves no lock file behind it
                    lock.unlink(missing_ok=True)
                raise
    except BaseException:
        for path in made:  # nor the (still empty) folders it made for the cache
            with contextlib.suppress(OSError):
                path.rmdir()
        raise
    for gone, freed in prune_orphans(root, folder):
        notice(f"removed the token cache {gone} ({freed / 2**20:,.1f} MiB): its data files are gone or changed")
    names = ", ".join(s.entry for s in sources)
    notice(f"tokenised {names} into {folder}: {counted(header['tokens'], 'token')}, "
           f"{counted(header['documents'], 'document')} in "
           f"{header['seconds']:.1f} s (reused until the data or the tokenizer changes)")
    return folder

"""The token cache: a folder holding a tokenised corpus on disk, opened, checked and read in place.

    TOKENS/
      tokens.bin      the token stream: every document's ids followed by the tokenizer's EOS id, as one
                      flat little-endian array (uint16 when the vocabulary fits in 65,536 ids, else uint32)
      documents.bin   int64 document boundaries, D + 1 of them: document d is tokens [b[d], b[d + 1])
                      and ends with its EOS (b[0] = 0, b[D] = the token count)
      header.json     written LAST: format version, dtype, token and document counts, EOS id, tokenizer
                      fingerprint, sources (path, size, mtime_ns, sampled bytes), text column, blake2b checksums of both
                      .bin files

Why flat binary files: a billion-token corpus is 2 GB of uint16 that any rank can read a window of
with one positioned read, with no parsing, no index and no Python object per token; the document
boundaries are what the held-out split needs. Why header.json last and the folder built beside its
final place and renamed in (see `token_build`): a folder with a header is always complete.

Windows are read with positioned reads (`os.pread`) rather than through `np.memmap`: the OS page cache
still holds the file once for all ranks, but mapped pages would count towards every rank's resident
memory (the kernel maps ~64 KB around each touched page), so a process reading random windows of a
100 GB cache would appear to grow towards 100 GB. Reads go through the same page cache, so their cost
is the same.

Opening checks, cheapest first: the header, the file sizes against its counts, the tokenizer
fingerprint, and (on one process, once per open) the checksums. Checksumming streams the files
through blake2b at roughly 1 GB/s on one core: about 2 s per billion uint16 tokens, with a progress bar
above 512 MB. A problem is a `CacheProblem`: the caller either rebuilds (an implicit cache) or stops
with its one-line message (a cache the user named).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from gqakit.common.errors import GqakitError

FORMAT = "gqakit-token-cache"
VERSION = 2  # 2: .txt line ends read as text mode reads them (\r\n -> \n), a long line cut at a space
HEADER, TOKENS, DOCUMENTS = "header.json", "tokens.bin", "documents.bin"
CHUNK = 8 << 20  # bytes per read when checksumming
PROGRESS_ABOVE = 512 << 20  # checksum progress bar for files larger than this


class CacheProblem(GqakitError):
    """A token cache that must not be used: missing, from another tokenizer, stale or corrupted.
    `reason` is the short cause (for the rebuild notice); the message is the one-line error with its fix."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32 (little-endian, fixed across machines)."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def is_token_cache(path: str | Path) -> bool:
    """True for a folder whose header.json says it is a gqakit token cache."""
    header = Path(path) / HEADER
    if not header.is_file():
        return False
    try:
        return json.loads(header.read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what the tokenizer does: its full serialised definition (vocabulary, merges,
    normaliser, pre-tokeniser, added tokens) with its EOS id and vocabulary size. Two folders holding
    the same tokenizer files (a model and its GQA conversion) agree; any edit to the vocabulary or rules
    changes it. Truncation and padding settings are left out: they do not change `add_special_tokens=False` ids."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("truncation", None)
        spec.pop("padding", None)
    else:  # a slow tokenizer: its vocabulary and the bytes of its vocabulary files
        spec = {"class": type(tokenizer).__name__, "vocab": sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])}
        folder = Path(getattr(tokenizer, "name_or_path", "") or ".")
        for name in sorted(getattr(tokenizer, "vocab_files_names", {}).values()):
            if (folder / name).is_file():
                spec[name] = hashlib.blake2b((folder / name).read_bytes(), digest_size=16).hexdigest()
    spec["eos_token_id"] = getattr(tokenizer, "eos_token_id", None)
    spec["vocab_size"] = len(tokenizer)
    blob = json.dumps(spec, sort_keys=True, ensure_ascii=False).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def file_checksum(path: Path, progress: bool = False, desc: str = "verify") -> str:
    """blake2b (128-bit) of a file, streamed in 8 MB reads."""
    from tqdm.auto import tqdm

    digest = hashlib.blake2b(digest_size=16)
    size = path.stat().st_size
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc=desc,
                                     disable=not progress or size < PROGRESS_ABOVE) as bar:
        while block := f.read(CHUNK):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def _read_at(fd: int, nbytes: int, offset: int) -> bytes:
    if hasattr(os, "pread"):
        return os.pread(fd, nbytes, offset)
    os.lseek(fd, offset, os.SEEK_SET)  # platforms without pread: one reader per process
    return os.read(fd, nbytes)


@dataclasses.dataclass
class TokenCache:
    """An opened token cache: reads spans of the stream and document boundaries without loading either."""

    path: Path
    header: dict

    def __post_init__(self):
        self.dtype = np.dtype(self.header["dtype"])
        self.tokens, self.documents = int(self.header["tokens"]), int(self.header["documents"])
        self._fds: dict[str, int] = {}

    def __getstate__(self):  # file descriptors do not travel to other processes; they reopen lazily
        return {"path": self.path, "header": self.header}

    def __setstate__(self, state):
        self.path, self.header = state["path"], state["header"]
        self.__post_init__()

    def _read(self, name: str, nbytes: int, offset: int) -> bytes:
        fd = self._fds.get(name)
        if fd is None:
            fd = self._fds[name] = os.open(self.path / name, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        data = _read_at(fd, nbytes, offset)
        if len(data) != nbytes:
            raise GqakitError(f"{self.path / name} ended early ({len(data)} of {nbytes} bytes at offset {offset}); "
                              f"the cache was truncated: rebuild it with gqakit tokenize --force")
        return data

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream, in the cache's dtype."""
        if not 0 <= start <= stop <= self.tokens:
            raise IndexError(f"tokens [{start}, {stop}) are outside the {self.tokens} tokens of {self.path}")
        size = self.dtype.itemsize
        return np.frombuffer(self._read(TOKENS, (stop - start) * size, start * size), dtype=self.dtype)

    def document(self, d: int) -> tuple[int, int]:
        """(start, stop) token offsets of document d, its EOS included."""
        if not 0 <= d < self.documents:
            raise IndexError(f"document {d} is outside the {self.documents} documents of {self.path}")
        start, stop = np.frombuffer(self._read(DOCUMENTS, 16, d * 8), dtype="<i8")
        return int(start), int(stop)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


def read_header(path: Path) -> dict:
    """header.json of a token cache; a `CacheProblem` when it is absent, unreadable or of another version."""
    fix = f"make it with gqakit tokenize DATA -o {path} --tokenizer MODEL"
    try:
        header = json.loads((path / HEADER).read_text())
    except FileNotFoundError:
        raise CacheProblem(f"{path} is not a gqakit token cache (no {HEADER}); {fix}", "has no header") from None
    except (OSError, ValueError) as e:
        raise CacheProblem(f"{path}/{HEADER} is unreadable ({type(e).__name__}); {fix} --force",
                           "has an unreadable header") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CacheProblem(f"{path} is not a gqakit token cache ({HEADER} has no format {FORMAT!r}); {fix}",
                           "is not a token cache")
    if header.get("version") != VERSION:
        raise CacheProblem(f"{path} is a version {header.get('version')} token cache but this gqakit reads version "
                           f"{VERSION}; {fix} --force", f"is format version {header.get('version')}")
    return header


def open_cache(path: str | Path, *, fingerprint: str | None = None, tokenizer_name: str = "MODEL",
               sources: list[dict] | None = None, verify: bool = False, progress: bool = False) -> TokenCache:
    """Open and check a token cache (see the module docstring for the order of the checks).

    `fingerprint`: the tokenizer in use (None: not checked), `tokenizer_name` where it came from (for the
    fix in the message). `sources`: the current (path, size,
    mtime_ns, sample) of the data it was made from (None: not checked; a cache the user made may outlive its
    sources). `verify`: recompute the checksums (do it on one process, once)."""
    path = Path(path)
    header = read_header(path)
    redo = f"rebuild it with gqakit tokenize DATA -o {path} --tokenizer MODEL --force"
    dtype = np.dtype(header["dtype"])
    for name, expected in ((TOKENS, header["tokens"] * dtype.itemsize), (DOCUMENTS, (header["documents"] + 1) * 8)):
        actual = (path / name).stat().st_size if (path / name).is_file() else None
        if actual != expected:
            raise CacheProblem(f"{path}/{name} holds {actual} bytes but {HEADER} promises {expected}; the cache is "
                               f"truncated or corrupted: {redo}",
                               f"has a {name} of the wrong size (truncated or corrupted)")
    if fingerprint is not None and header["tokenizer"]["fingerprint"] != fingerprint:
        raise CacheProblem(
            f"{path} was tokenised by another tokenizer ({header['tokenizer']['name']}, fingerprint "
            f"{header['tokenizer']['fingerprint'][:12]}, not {fingerprint[:12]}); re-run gqakit tokenize with "
            f"--tokenizer {tokenizer_name}", "was made with another tokenizer")
    if sources is not None and not _same_sources(header["sources"], sources):
        recorded = header["sources"]  # the first file that differs, else one added or gone
        changed = next((s["path"] for r, s in zip(recorded, sources) if not same_file(r, s)), None) or next(
            (s["path"] for s in sources[len(recorded):] or recorded[len(sources):]), "?")
        raise CacheProblem(f"{path} is stale: {changed} changed since it was tokenised; {redo}",
                           f"is stale ({changed} changed since it was tokenised)")
    if verify:
        for name in (TOKENS, DOCUMENTS):
            if file_checksum(path / name, progress, desc=f"verify {name}") != header["checksums"][name]:
                raise CacheProblem(f"{path}/{name} does not match its checksum (corrupted); {redo}",
                                   f"has a corrupted {name} (it does not match its checksum)")
    return TokenCache(path, header)


def same_file(recorded: dict, now: dict) -> bool:
    """Whether a source file is as a cache recorded it (`sources.describe_files`): every field the record holds (a
    cache made before the sample was recorded is compared on path, size and mtime)."""
    return all(now.get(key) == value for key, value in recorded.items())


def _same_sources(recorded: list[dict], now: list[dict]) -> bool:
    return len(recorded) == len(now) and all(same_file(r, n) for r, n in zip(recorded, now))


def _text_heads(entry: str) -> set[str]:
    """What names the texts of a data entry for `refuse_repeated_texts`: a hub name as given; otherwise the sha256
    of each data file's first bytes, as `common.fitted` digests them: a token cache's sources as its header recorded
    them when built, else those it lists that are still here."""
    from gqakit.common import fitted

    if entry.startswith("hf:"):
        return {entry}
    path = Path(entry).expanduser()
    if is_token_cache(path):
        header = json.loads((path / HEADER).read_text())
        sources = [f["path"] for f in header.get("sources") or () if isinstance(f, dict) and f.get("path")]
        found = header.get("fitted") or fitted.entries([s for s in sources if Path(s).is_file()], "uptraining")
    else:
        found = fitted.entries([path], "uptraining")
    return {e.get("head_sha256") for e in found if isinstance(e, dict)} - {None}


def refuse_repeated_texts(entries: list[str], fix: str) -> None:
    """Refuse data that holds one text twice: the same path, a copy, one that starts as another does
    (`overlap.refuse_shared`), a token cache of another entry's text, two caches of one text, one hub name twice."""
    from gqakit.common.overlap import refuse_shared

    heads = [_text_heads(entry) for entry in entries]
    for i, entry in enumerate(entries):
        refuse_shared(("data", entry), [("data", other) for other in entries[i + 1:]], fix)
        for j in range(i + 1, len(entries)):
            if heads[i] & heads[j]:
                raise GqakitError(f"data {entry} and data {entries[j]} hold the same text (a token cache of the "
                                  f"other's text, two caches of one text, or one hub name twice), so the held-out "
                                  f"score would count text the model was fitted on; {fix}")

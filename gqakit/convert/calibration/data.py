"""Calibration text for `convert-gqa --calibration`: read with the evaluation loaders, tokenized with the
model's own tokenizer, cut into disjoint windows, checked (`check.py`, which a dry run also makes without torch),
and fingerprinted for the model card.

Reading text reuses `gqakit.common.text` (a .txt document, or JSON lines / JSON / parquet rows), so
calibration accepts exactly what `gqakit eval` accepts. This is the one place `convert` reaches into
`evaluate`; it imports nothing else from it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import sys
from pathlib import Path

import torch

from gqakit.common.digest import sha256_of
from gqakit.common.errors import GqakitError
from gqakit.common.precision import auto_dtype
from gqakit.convert.calibration.check import calibration_window, check_ids, heldout_count, read_calibration


@dataclasses.dataclass(frozen=True)
class CalibrationData:
    path: str | None  # None: the model's own samples (`sampled`)
    windows: torch.Tensor  # (N, T) token ids; the last `heldout` windows score the merge
    heldout: int
    sha256: str  # of the token ids used (int64, little-endian), which pins text, tokenizer and cut
    file_sha256: str | None  # of the calibration file's bytes (a folder: of its files' bytes in name order)
    sampled: dict | None = None  # how the model's own samples were drawn: seed, temperature, top_p, dtype

    @property
    def window(self) -> int:
        return self.windows.shape[1]

    @property
    def tokens(self) -> int:
        return self.windows.numel()


def load_calibration(path: str, model_dir: Path, config: dict, tokens: int, window: int | None,
                     text_column: str = "text") -> CalibrationData:
    """Tokenize `path` with the tokenizer in `model_dir` into windows; one-line errors for every bad input."""
    from gqakit.common.text import encode_documents

    window = calibration_window(config, tokens, window)
    documents = read_calibration(path, text_column)
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # no tokenizer files, or broken ones
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GqakitError(f"--calibration needs the model's tokenizer, but {model_dir} has none that loads ({first}); "
                          "copy the tokenizer files into the model folder") from None
    try:
        ids = encode_documents(documents, tokenizer, tokens)
    except GqakitError as e:
        raise GqakitError(f"calibration data {path}: {e}") from None
    check_ids(path, model_dir, ids.tolist(), config.get("vocab_size"), window)
    windows = make_windows(ids, window, tokens)
    return CalibrationData(
        path=str(path), windows=windows, heldout=heldout_count(windows.shape[0]),
        sha256=hashlib.sha256(windows.to(torch.int64).numpy().tobytes()).hexdigest(),
        file_sha256=sha256_of(Path(path)),
    )


def sample_calibration(model_dir: Path, config: dict, tokens: int, window: int | None, seed: int, device: str,
                       progress: bool = True, keep: bool = True) -> CalibrationData:
    """Data-free calibration: tokens // window windows of the model's own text, each a new document (its start
    token, then window - 1 tokens drawn at temperature 1 from the full distribution: `gqakit sample`'s sampler,
    in its `--dtype auto`), deterministic for a seed on one machine. The model is loaded whole, on `device`, for
    the sampling. With `keep`, the windows are kept on disk and a later call with the same model, sampling and
    machine reads them instead of sampling again (`sample_cache`)."""
    from gqakit.convert.calibration import sample_cache

    window = calibration_window(config, tokens, window)
    dtype = auto_dtype("auto", device)
    sampled = {"seed": seed, "temperature": 1.0, "top_p": 1.0, "dtype": dtype}
    key = sample_cache.sample_key(model_dir, {**sampled, "tokens": tokens, "window": window}, device) if keep else None
    kept = sample_cache.load_sample(key) if keep else None
    if kept is not None:
        windows, path = kept
        print(f"calibration: the same {windows.numel():,} tokens were sampled before; read from {path}",
              file=sys.stderr, flush=True)
    else:
        windows = _sample_windows(model_dir, tokens // window, window, seed, dtype, device, progress)
        if keep:
            sample_cache.store_sample(key, windows)
    return CalibrationData(
        path=None, windows=windows, heldout=heldout_count(windows.shape[0]),
        sha256=hashlib.sha256(windows.to(torch.int64).numpy().tobytes()).hexdigest(), file_sha256=None,
        sampled=sampled)


def _sample_windows(model_dir: Path, count: int, window: int, seed: int, dtype: str, device: str,
                    progress: bool) -> torch.Tensor:
    from tqdm.auto import tqdm

    from gqakit.convert.calibration.sample import BATCH, progress_step, sampled_batches, start_token
    from gqakit.hf.loading import load_model

    model, _ = load_model(str(model_dir), dtype=dtype, device=device, with_tokenizer=False)  # ids in, ids out
    start = start_token(model.config)
    rows = []
    with tqdm(total=count * window, desc="sample", unit="tok", unit_scale=True, disable=not progress) as bar:
        bar.update(count)  # the start tokens
        for ids in sampled_batches(model, start, count, window - 1, 1.0, 1.0, seed, BATCH,
                                   on_step=progress_step(bar)):
            rows.append(torch.cat([torch.full((ids.shape[0], 1), start, dtype=ids.dtype), ids.cpu()], dim=1))
    del model
    return torch.cat(rows)


def make_windows(ids: torch.Tensor, window: int, tokens: int) -> torch.Tensor:
    """Disjoint windows (N, window) from the first `tokens` ids (a partial last window is dropped)."""
    count = min(tokens, ids.numel()) // window
    return ids[: count * window].reshape(count, window)

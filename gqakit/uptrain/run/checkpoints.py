"""Resumable training checkpoints with `torch.distributed.checkpoint` (DCP), written atomically and
read without arbitrary unpickling.

    OUTPUT/checkpoints/step-000050/
        state/                  DCP: model parameters and AdamW moments; each rank writes its own shards
                                (FSDP) or one rank writes each replicated tensor (DDP); no rank gathers
        trainer.json            optimizer param groups (lr, betas...), LR scheduler, fp16 loss scale
        rank-00000.json ...     per process: step, data position, metrics so far, RNG states
        recipe.json             the recipe that wrote it; written last, it marks the folder complete

DCP stores tensors with their global shapes and shard offsets, so a checkpoint loads onto any number
of processes (it reshards) and onto either sharding. Only tensors go through DCP; everything else is
JSON. DCP reads tensors with `torch.load(weights_only=True)` and its index (`.metadata`) with pickle:
that one file is read here by an unpickler that accepts DCP's own metadata classes and nothing else.

A checkpoint folder is written under a temporary name and renamed when complete, so a crash while
writing (even SIGKILL) leaves the previous checkpoint intact: a run loses at most one interval.
"""
from __future__ import annotations

import json
import pickle
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

from gqakit.common.atomic import interrupts_deferred, publish
from gqakit.common.errors import GqakitError

CHECKPOINTS = "checkpoints"
_PREFIX = "step-"
_SAFE_GLOBALS = {  # what DCP's .metadata pickle may name
    ("torch.distributed.checkpoint.metadata", None), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"), ("torch", "Size"), ("torch", "float32"),
    ("torch", "bfloat16"), ("torch", "float16"), ("torch", "float64"), ("torch", "int64"), ("torch", "int32"),
    ("torch", "uint8"), ("torch", "bool"), ("torch", "strided"), ("torch", "contiguous_format"),
    ("torch._utils", "_get_layout"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, None) in _SAFE_GLOBALS or (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata names {module}.{name}, which a DCP index never holds")


def _reader(path: Path):
    """DCP's file reader with the restricted metadata unpickler."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with open(Path(self.path) / ".metadata", "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def checkpoint_dirs(output_dir: Path) -> list[Path]:
    """Complete checkpoints of a run folder, oldest first."""
    root = Path(output_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and (p / "recipe.json").is_file()]
    return sorted(done, key=lambda p: int(p.name[len(_PREFIX):]))


def rng_state() -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, py_gauss = random.getstate()
    state = {"python": [version, list(internal), py_gauss],
             "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
             "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, gauss_np = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss_np))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _dcp_state(model, optimizer) -> tuple[dict, list]:
    """({"model": ..., "optimizer": ...} tensors for DCP, the optimizer's param groups for JSON)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state["state"]}, optim_state["param_groups"]


def _single() -> bool:
    return not torch.distributed.is_initialized()


def save_checkpoint(output_dir: Path, step: int, *, model, optimizer, trainer_state: dict, rank_state: dict,
                    rank: int, recipe: dict, is_main: bool, barrier, keep: int) -> Path:
    """Write checkpoint `step`; every rank calls this (`barrier()` synchronises them)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    root = Path(output_dir) / CHECKPOINTS
    final = root / f"{_PREFIX}{step:06d}"
    tmp = root / f".{final.name}.tmp"
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    tensors, param_groups = _dcp_state(model, optimizer)
    with interrupts_deferred():  # a stop mid-write would reach DCP's C++ writer and come back as a RuntimeError
        try:
            with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(tmp / "state"), overwrite=True),
                         no_dist=_single())
            if is_main:
                (tmp / "trainer.json").write_text(json.dumps({**trainer_state, "param_groups": param_groups}))
            (tmp / f"rank-{rank:05d}.json").write_text(json.dumps({**rank_state, "rng": rng_state()}))
        except (OSError, RuntimeError, CheckpointException) as e:  # DCP reports a full disk as CheckpointException
            shutil.rmtree(tmp, ignore_errors=True)
            interrupt = _interrupt_inside(e)
            if interrupt is not None:  # Ctrl-C or SIGTERM while DCP wrote: a stop, not a failed write
                raise interrupt from None
            raise _write_failed(output_dir, final.name, e) from None
        except KeyboardInterrupt:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        barrier()
        if is_main:
            (tmp / "recipe.json").write_text(json.dumps(recipe, indent=2))  # last: marks the folder complete
            publish(tmp, final, force=True)  # an older folder of this step (a rerun) is swapped out
            for old in checkpoint_dirs(output_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
        barrier()
    return final


def _interrupt_inside(error: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C / SIGTERM that DCP wrapped in a CheckpointException (one rank's failure), if that is what it was."""
    failures = getattr(error, "failures", None) or {}
    for pair in failures.values():
        exc = pair[0] if isinstance(pair, tuple) else pair
        if isinstance(exc, KeyboardInterrupt):
            return exc
    return None


def _write_failed(output_dir: Path, name: str, error: Exception) -> GqakitError:
    """One line for a checkpoint that could not be written: the cause, the free space, what is kept."""
    text = str(error).strip()
    cause = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), type(error).__name__)
    free = shutil.disk_usage(output_dir).free
    kept = checkpoint_dirs(output_dir)
    resume = f"run the same command to resume from {kept[-1].name}" if kept else "run the same command to start again"
    return GqakitError(f"writing checkpoint {name} failed ({cause[:200]}); {free / 2**20:,.0f} MiB are free on "
                       f"{output_dir}: free space (or lower keep_checkpoints), then {resume}")


def load_checkpoint(folder: Path, model, optimizer) -> dict:
    """Load a checkpoint's model and optimizer state in place (resharding as needed); returns the
    trainer state (scheduler, loss scale)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    tensors, _ = _dcp_state(model, optimizer)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tensors, storage_reader=_reader(folder / "state"), no_dist=_single())
    trainer_state = json.loads((folder / "trainer.json").read_text())
    groups = trainer_state.pop("param_groups")
    for group in groups:  # JSON turned tuples into lists
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    set_state_dict(model, optimizer, model_state_dict=tensors["model"],
                   optim_state_dict={"state": tensors["optimizer"], "param_groups": groups})
    return trainer_state


def rank_record(folder: Path, rank: int) -> dict | None:
    """What process `rank` recorded in a checkpoint (step, data position, RNG), if it took part."""
    path = folder / f"rank-{rank:05d}.json"
    return json.loads(path.read_text()) if path.is_file() else None

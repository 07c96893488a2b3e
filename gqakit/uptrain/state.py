"""Resumable training checkpoints, written atomically and read without arbitrary unpickling.

    OUTPUT/checkpoints/step-000050/
        model.safetensors       every parameter, fp32 (safetensors)
        trainer_state.pt        optimizer, LR-scheduler (and fp16 loss-scaler) state dicts: tensors and
                                numbers only, read back with torch.load(weights_only=True), whose
                                restricted unpickler refuses anything else
        rank-00000.json ...     per process: step, data position, metrics so far, RNG states
        recipe.json             the recipe that wrote it (a resume with a different one is refused)

A checkpoint folder is written under a temporary name and renamed when complete, so a crash while
writing leaves the previous checkpoint intact: a run loses at most one checkpoint interval.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

CHECKPOINTS = "checkpoints"
_PREFIX = "step-"


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


def save_checkpoint(output_dir: Path, step: int, *, model_state: dict, trainer_state: dict | None,
                    rank_state: dict, rank: int, recipe: dict, is_main: bool, barrier, keep: int) -> Path:
    """Write checkpoint `step` (every rank calls this; `barrier()` synchronises them)."""
    root = Path(output_dir) / CHECKPOINTS
    final = root / f"{_PREFIX}{step:06d}"
    tmp = root / f".{final.name}.tmp"
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    if is_main:
        save_file({k: v.detach().float().cpu().clone() for k, v in model_state.items()},  # clone: tied weights
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        torch.save(trainer_state, tmp / "trainer_state.pt")
    (tmp / f"rank-{rank:05d}.json").write_text(json.dumps({**rank_state, "rng": rng_state()}))
    barrier()
    if is_main:
        (tmp / "recipe.json").write_text(json.dumps(recipe, indent=2))  # last: marks the folder complete
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in checkpoint_dirs(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def load_checkpoint(folder: Path, rank: int) -> tuple[dict, dict, dict]:
    """(model state, trainer state, this rank's state) of a checkpoint folder."""
    model_state = load_file(str(folder / "model.safetensors"))
    trainer_state = torch.load(folder / "trainer_state.pt", weights_only=True, map_location="cpu")
    # run_folder.plan_run has checked that the same number of processes resumes it
    return model_state, trainer_state, json.loads((folder / f"rank-{rank:05d}.json").read_text())

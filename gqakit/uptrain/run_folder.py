"""The run folder's life cycle (fresh, resume, finished) and the process-count checks at start-up."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..errors import GqakitError
from .state import checkpoint_dirs

MARKER = "uptrain-recipe.json"  # written when a run starts: this folder belongs to gqakit uptrain
FINISHED = "uptraining.json"  # written last: the final model in this folder is complete
# Keys that may change between an interrupted run and its resumption without changing the run. The
# process layout may change too (DCP reshards): `shape` then checks that the global batch is the same.
RESUME_FREE = {"progress", "force", "threads", "checkpoint_every", "keep_checkpoints", "delete_checkpoints", "log_every",
               "batch_size", "gradient_accumulation_steps", "context_parallel", "num_processes", "sharding",
               "cache_dir", "num_proc", "device_memory"}
# What the launch must keep for a resumed run to continue the same run: steps and tokens per step.
SAME_RUN = ("steps", "tokens_per_step")


def _identity(recipe: dict) -> dict:
    return {k: v for k, v in recipe.items() if k not in RESUME_FREE}


def plan_run(output_dir: str | Path, recipe: dict, force: bool, shape: dict) -> Path | None:
    """Decide, reading only, what to do with the run folder: the checkpoint to resume from, or None
    for a fresh start. Refuses (one line, before any work) a folder that is not ours, a finished run,
    a run of another recipe, or one whose launch (`shape`) splits the budget into other steps, unless `force`.
    Another number of processes, context parallelism or sharding resumes (resharded), provided the
    global batch (tokens per step) and the step count are the same."""
    out = Path(output_dir)
    if not out.exists() or force:
        return None
    if not out.is_dir():
        raise GqakitError(f"output_dir {out} is a file; choose another output_dir")
    if not (out / MARKER).is_file():
        if any(out.iterdir()):
            raise GqakitError(f"output_dir {out} is not empty and not a gqakit uptrain run; choose another "
                              "output_dir or pass force=true to replace it")
        return None
    if (out / FINISHED).is_file():
        raise GqakitError(f"output_dir {out} holds a finished run; choose another output_dir or pass force=true "
                          "to train again from scratch")
    checkpoints = checkpoint_dirs(out)
    if not checkpoints:
        return None  # an earlier attempt stopped before its first checkpoint: nothing to resume
    saved = json.loads((checkpoints[-1] / "recipe.json").read_text())
    mine, theirs = _identity(recipe), _identity(saved)
    if mine != theirs:
        key = next(k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k))
        raise GqakitError(f"output_dir {out} holds an interrupted run of another recipe ({key}: "
                          f"{theirs.get(key)!r} there, {mine.get(key)!r} here); resume it with the same recipe, "
                          "choose another output_dir, or pass force=true to start over")
    theirs = json.loads((checkpoints[-1] / "rank-00000.json").read_text()).get("shape", {})
    for key in SAME_RUN:
        if theirs.get(key) != shape.get(key):
            raise GqakitError(
                f"output_dir {out} holds a run checkpointed with {key}={theirs.get(key)} but this launch has "
                f"{key}={shape.get(key)} ({theirs.get('processes')} processes then, {shape.get('processes')} now); "
                "keep the global batch: batch_size x gradient_accumulation_steps x data-parallel processes must stay "
                "the same (e.g. double gradient_accumulation_steps on half the processes), or pass force=true")
    return checkpoints[-1]


def start_run(output_dir: str | Path, recipe: dict, fresh: bool) -> None:
    """Main process only: create (or, for a forced fresh start, empty) the folder and mark it."""
    out = Path(output_dir)
    if fresh and out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text(json.dumps(recipe, indent=2) + "\n")


def _launcher_processes() -> int | None:
    """N of an `accelerate launch ... --num_processes N` that started this process, if any."""
    try:
        args = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    if not any(Path(a).name.startswith("accelerate") for a in args[:4]):  # accelerate, -m accelerate.commands.launch
        return None
    for i, arg in enumerate(args):
        for flag in ("--num_processes", "--num-processes"):
            if arg == flag and i + 1 < len(args) and args[i + 1].isdigit():
                return int(args[i + 1])
            if arg.startswith(flag + "=") and arg.split("=", 1)[1].isdigit():
                return int(arg.split("=", 1)[1])
    return None


def check_processes(expected: int | None, context_parallel: int) -> int:
    """The world size this process runs in; refuses a silent single-process start and a world the
    context-parallel degree does not divide. Runs before the Accelerator is built."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    asked = _launcher_processes()
    if world == 1 and asked and asked > 1:
        raise GqakitError(f"accelerate launch asked for {asked} processes but started one (accelerate launch --cpu "
                          f"does that); on CPU use torchrun --nproc_per_node {asked} -m gqakit.cli uptrain ..., or "
                          f"accelerate launch --multi_gpu --num_processes {asked} with no --cpu")
    if expected is not None and world != expected:
        raise GqakitError(f"the recipe expects num_processes={expected} but this run has {world}; launch "
                          f"{expected} processes (torchrun --nproc_per_node {expected} ...) or change num_processes")
    if world % context_parallel:
        raise GqakitError(f"context_parallel={context_parallel} does not divide the {world} processes; launch a "
                          f"multiple of {context_parallel} processes or change context_parallel")
    return world

"""The run folder's life cycle (fresh, resume, finished) and the process-count checks at start-up."""
from __future__ import annotations

import fnmatch
import json
import os
import shutil
from pathlib import Path

from gqakit.common import launcher
from gqakit.common.errors import GqakitError
from gqakit.uptrain.run.lock import LOCK
from gqakit.uptrain.run.checkpoints import CHECKPOINTS, checkpoint_dirs

MARKER = "uptrain-recipe.json"  # written when training starts: this folder belongs to gqakit uptrain
FINISHED = "uptraining.json"  # written last: the final model in this folder is complete; lists its files
# What a run writes besides the final model's files (which FINISHED lists). `--force` replaces a run
# folder only when every entry in it is one of these: it never deletes a file gqakit did not write.
RUN_ENTRIES = (MARKER, FINISHED, LOCK, CHECKPOINTS, "metrics.csv", "loss.png", "tensorboard", ".final.tmp")
# The final model's files, for a finished run recorded before FINISHED listed them.
MODEL_ENTRIES = ("config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json",
                 "README.md", "tokenizer*", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                 "vocab.json", "merges.txt", "pretraining.json")
# Keys that may change between an interrupted run and its resumption without changing the run. The
# process layout may change too (DCP reshards): `shape` then checks that the global batch is the same.
RESUME_FREE = {"progress", "force", "threads", "checkpoint_every", "keep_checkpoints", "delete_checkpoints",
               "log_every", "batch_size", "gradient_accumulation_steps", "context_parallel", "num_processes",
               "sharding", "cache_dir", "num_proc", "device_memory"}
# What the launch must keep for a resumed run to continue the same run: steps and tokens per step.
SAME_RUN = ("steps", "tokens_per_step")


def _identity(recipe: dict) -> dict:
    return {k: v for k, v in recipe.items() if k not in RESUME_FREE}


def _entries(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name != LOCK)


def own_entries(out: Path) -> tuple[list[str], list[str]]:
    """(entries gqakit wrote, entries it did not) of the run folder `out`."""
    listed: list[str] = []
    if (out / FINISHED).is_file():
        try:
            listed = list(json.loads((out / FINISHED).read_text()).get("files") or [])
        except (ValueError, AttributeError):
            listed = []
    patterns = (*RUN_ENTRIES, *(listed or MODEL_ENTRIES))
    ours, theirs = [], []
    for name in _entries(out):
        (ours if any(fnmatch.fnmatchcase(name, p) for p in patterns) else theirs).append(name)
    return ours, theirs


def _check_replaceable(out: Path) -> None:
    """--force may replace an empty folder or a gqakit run folder holding only what gqakit wrote."""
    if not _entries(out):
        return
    if not (out / MARKER).is_file():
        raise GqakitError(f"output_dir {out} is not empty and not a gqakit uptrain run, so force will not replace "
                          "it (it may hold your files); choose another output_dir")
    _, theirs = own_entries(out)
    if theirs:
        more = f" (and {len(theirs) - 1} more)" if len(theirs) > 1 else ""
        raise GqakitError(f"output_dir {out} holds {theirs[0]}{more}, which gqakit did not write, so force will not "
                          "replace the run; move it out or choose another output_dir")


def plan_run(output_dir: str | Path, recipe: dict, force: bool, shape: dict) -> Path | None:
    """Decide, reading only, what to do with the run folder: the checkpoint to resume from, or None
    for a fresh start. Refuses (one line, before any work) a folder that is not ours, a finished run,
    a run of another recipe, or one whose launch (`shape`) splits the budget into other steps, unless `force`;
    `force` itself is refused for a folder holding anything gqakit did not write.
    Another number of processes, context parallelism or sharding resumes (resharded), provided the
    global batch (tokens per step) and the step count are the same."""
    out = Path(output_dir)
    if not out.exists():
        return None
    if not out.is_dir():
        raise GqakitError(f"output_dir {out} is a file; choose another output_dir")
    if force:
        _check_replaceable(out)
        return None
    if not (out / MARKER).is_file():
        if _entries(out):
            raise GqakitError(f"output_dir {out} is not empty and not a gqakit uptrain run; choose another "
                              "output_dir")
        return None
    if (out / FINISHED).is_file():
        raise GqakitError(f"output_dir {out} holds a finished run; choose another output_dir or pass force=true "
                          "to train again from scratch")
    checkpoints = checkpoint_dirs(out)
    if not checkpoints:
        _check_replaceable(out)
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
    """Main process only, holding the run lock, once the models and data have loaded: for a fresh
    start remove what an earlier run wrote (only that: `plan_run` checked), then mark the folder."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if fresh:
        _check_replaceable(out)
        for name in own_entries(out)[0]:
            path = out / name
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
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
    world = launcher.world_size()
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

"""`gqakit uptrain` under bad input and faults, through the real console script: one line and exit 2,
nothing of the user's lost, no run folder left by a failed start, divergence never reported as success."""
from __future__ import annotations

import fcntl
import json
import os
import resource
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from cli_contract import assert_one_line_error, console_script, run_cli, run_refused
from uptrain_tiny import make_text, make_uptrain_model, write_recipe


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    return {"model": make_uptrain_model(root / "gqa"), "text": make_text(root / "train.txt")}


def _recipe(tiny, tmp_path: Path, **fields) -> Path:
    fields = {"model": str(tiny["model"]), "data": [str(tiny["text"])], "output_dir": str(tmp_path / "run"),
              "steps": 2, **fields}
    return write_recipe(tmp_path / "r.yaml", **fields)


# ---- recipes: types and ranges, declared once on the dataclass fields ------------------------------

BAD_FIELDS = [("min_lr_ratio=-1", "must be >= 0"), ("grad_clip=-1", "must be >= 0"),
              ("warmup_fraction=2", "must be <= 1"), ("steps=true", "must be an integer"),
              ("gradient_checkpointing=maybe", "must be true or false"), ("betas=[2,3]", "must be < 1"),
              ("betas=[0.9]", "exactly 2 items"), ("steps=.inf", "must be an integer"),
              ("steps=.nan", "must be an integer"), ("steps=[1,2]", "must be an integer"),
              ("lr=.nan", "must be a finite number"), ("lr=.inf", "must be a finite number"),
              ("lr=-1", "must be > 0"), ("eval_fraction=0.7", "must be < 0.5"), ("seed=-3", "must be >= 0"),
              ("progress=1", "must be true or false"), ("data=3", "must hold items that each be a string")]


def test_fields_out_of_range_or_of_the_wrong_type_are_refused_before_any_work(tiny, tmp_path):
    recipe = _recipe(tiny, tmp_path)
    for override, why in BAD_FIELDS:
        key = override.partition("=")[0]
        run_refused(tmp_path, "gqakit", "uptrain", str(recipe), override, needles=(f"{key}=", why))


def test_fields_are_checked_however_the_config_is_built(tiny, tmp_path):
    from gqakit.common.errors import GqakitError
    from gqakit.uptrain import UptrainConfig

    with pytest.raises(GqakitError, match="lr=nan must be a finite number"):
        UptrainConfig(model="m", output_dir="o", steps=1, lr=float("nan"))
    ok = UptrainConfig(model="m", output_dir="o", steps=1)
    with pytest.raises(GqakitError, match="warmup_fraction=2 must be <= 1"):
        __import__("dataclasses").replace(ok, warmup_fraction=2)


def test_broken_recipe_files_are_one_line(tiny, tmp_path):
    (tmp_path / "broken.yaml").write_text("model: m\nsteps: [1, 2\n")
    run_refused(tmp_path, "gqakit", "uptrain", str(tmp_path / "broken.yaml"), needles=("is not valid YAML at line",))
    (tmp_path / "binary.yaml").write_bytes(bytes(range(256)) * 4)
    run_refused(tmp_path, "gqakit", "uptrain", str(tmp_path / "binary.yaml"), needles=("is not UTF-8 text",))
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    run_refused(tmp_path, "gqakit", "uptrain", str(tmp_path / "list.yaml"), needles=("must be a mapping",))


def test_a_model_folder_without_weights_is_one_line(tiny, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(tiny["model"], bare)
    (bare / "model.safetensors").unlink()
    run_refused(tmp_path, "gqakit", "uptrain", str(_recipe(tiny, tmp_path, model=str(bare))),
                needles=("has no model.safetensors",))


def test_a_model_folder_missing_a_weight_is_one_line_not_a_random_tensor_trained(tiny, tmp_path):
    """uptrain loaded with from_pretrained alone: a weight absent from the checkpoint was left random and trained
    (a review: an untied model without its lm_head, "held-out perplexity 4137.45 -> 4137.45"). Refused as eval does."""
    from safetensors.torch import load_file, save_file

    holed = tmp_path / "holed"
    shutil.copytree(tiny["model"], holed)
    weights = load_file(holed / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, str(holed / "model.safetensors"), metadata={"format": "pt"})
    run_refused(tmp_path, "gqakit", "uptrain", str(_recipe(tiny, tmp_path, model=str(holed))),
                needles=("the weights lack model.norm.weight", "re-download or re-save it"))


# ---- nothing of the user's is lost ---------------------------------------------------------------


def test_force_never_deletes_what_gqakit_did_not_write(tiny, tmp_path):
    """The sweep's cases: output_dir set to the folder that holds eval_data (and a notes.txt), or to a
    folder holding thesis.tex, was deleted by --force."""
    folder = tmp_path / "work"
    folder.mkdir()
    shutil.copy(tiny["text"], folder / "eval.txt")
    (folder / "notes.txt").write_text("mine")
    recipe = _recipe(tiny, tmp_path, output_dir=str(folder), eval_data=[str(folder / "eval.txt")])
    run_refused(tmp_path, "gqakit", "uptrain", str(recipe), "--force", needles=("overlaps the eval_data path",))
    run_refused(tmp_path, "gqakit", "uptrain", str(recipe), "force=true", needles=("overlaps the eval_data path",))
    thesis = tmp_path / "thesis"
    thesis.mkdir()
    (thesis / "thesis.tex").write_text("\\documentclass{article}")
    recipe = _recipe(tiny, tmp_path, output_dir=str(thesis))
    run_refused(tmp_path, "gqakit", "uptrain", str(recipe), "--force", needles=("not a gqakit uptrain run",))
    assert (thesis / "thesis.tex").read_text() == "\\documentclass{article}"


def test_force_replaces_a_run_folder_only_while_it_holds_only_the_runs_files(tiny, tmp_path):
    recipe = _recipe(tiny, tmp_path, steps=1)
    assert run_cli("gqakit", "uptrain", str(recipe), "-q").returncode == 0
    run = tmp_path / "run"
    files = json.loads((run / "uptraining.json").read_text())["files"]
    assert "model.safetensors" in files and "config.json" in files
    (run / "my-eval.txt").write_text("mine")
    run_refused(tmp_path, "gqakit", "uptrain", str(recipe), "--force", needles=("holds my-eval.txt",))
    (run / "my-eval.txt").unlink()
    (run / "tensorboard").mkdir()  # what metrics.py's SummaryWriter writes where tensorboard is installed: ours
    (run / "tensorboard" / "events.out.tfevents.0.host.0.0").write_bytes(b"")
    done = run_cli("gqakit", "uptrain", str(recipe), "--force", "-q")
    assert done.returncode == 0, done.stderr
    assert (run / "model.safetensors").is_file() and not (run / "uptrain.lock").exists()


def test_a_second_run_into_a_locked_folder_is_refused(tiny, tmp_path):
    recipe = _recipe(tiny, tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "uptrain.lock", "w") as lock:  # held like a live run holds it
        lock.write(json.dumps({"pid": os.getpid(), "host": "here", "started": "now"}))
        lock.flush()
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        run_refused(tmp_path, "gqakit", "uptrain", str(recipe), needles=(f"in use by another uptrain run (pid "
                                                                        f"{os.getpid()} on here",))


def test_a_lock_left_by_a_dead_run_is_taken_over_with_a_message(tiny, tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    run = tmp_path / "run"
    run.mkdir()
    (run / "uptrain.lock").write_text(json.dumps({"pid": dead.pid, "host": "there", "started": "then"}))
    done = run_cli("gqakit", "uptrain", str(_recipe(tiny, tmp_path, steps=1)))
    assert done.returncode == 0, done.stderr
    assert f"taking over {run / 'uptrain.lock'} from a run that is no longer running (pid {dead.pid}" in done.stderr
    assert (run / "uptraining.json").is_file() and not (run / "uptrain.lock").exists()


def test_a_failed_start_leaves_no_run_folder(tiny, tmp_path):
    broken = tmp_path / "broken-tokenizer"
    shutil.copytree(tiny["model"], broken)
    (broken / "tokenizer.json").write_text("{not json")
    run_refused(tmp_path, "gqakit", "uptrain", str(_recipe(tiny, tmp_path, model=str(broken))),
                needles=("cannot load a tokenizer from",))
    assert not (tmp_path / "run").exists()


# ---- divergence and a full disk --------------------------------------------------------------------


def test_a_diverging_run_stops_without_a_final_model(tiny, tmp_path):
    recipe = _recipe(tiny, tmp_path, steps=6, lr=1e30, warmup_steps=0, grad_clip=0.0, checkpoint_every=1)
    done = run_cli("gqakit", "uptrain", str(recipe), "-q")
    line = assert_one_line_error(done, "gqakit", "so training diverged and no final model was written",
                                 "lower lr (now 1e+30)")
    step = int(line.split("step ")[1].split(":")[0])
    run = tmp_path / "run"
    assert not (run / "model.safetensors").exists() and not (run / "uptraining.json").exists()
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept and kept[-1] == f"step-{step - 1:06d}" and f"checkpoint {kept[-1]} is kept" in line
    rows = (run / "metrics.csv").read_text().splitlines()
    assert rows[-1].startswith(f"{step},") and "nan" in rows[-1]  # the failing step is on record


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_leaves_no_torn_folder(tiny, tmp_path):
    """A file-size limit (ulimit -f) makes the checkpoint's write fail as a full disk would, while the
    small files before it still fit."""
    recipe = _recipe(tiny, tmp_path, steps=3, checkpoint_every=1)

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing us
        resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))

    done = subprocess.run([console_script("gqakit"), "uptrain", str(recipe), "-q"], capture_output=True, text=True,
                          preexec_fn=limit, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert_one_line_error(done, "gqakit", "writing checkpoint step-000001 failed", "MiB are free on",
                          "run the same command to start again")
    left = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert left == [], left
    assert not (tmp_path / "run" / "uptrain.lock").exists()


def test_sigterm_says_how_to_resume_and_exits_143(tiny, tmp_path):
    """SIGTERM (what kill, systemd and schedulers send) stops a run as Ctrl-C does: one line that says how to
    resume, exit 128 + 15, the last checkpoint kept."""
    import time

    recipe = _recipe(tiny, tmp_path, steps=400, checkpoint_every=1, eval_every=0)
    run = tmp_path / "run"
    proc = subprocess.Popen([console_script("gqakit"), "uptrain", str(recipe)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline and not list(run.glob("checkpoints/step-*")):
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be stopped"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err.decode(errors="replace")
    assert proc.returncode == 143, err
    assert "Traceback" not in err and \
        "gqakit: terminated; the checkpoints written so far are kept" in err, err
    assert list(run.glob("checkpoints/step-*"))


def test_an_interrupt_inside_a_checkpoint_write_is_a_stop_not_a_failed_write(tmp_path, monkeypatch):
    """DCP wraps whatever stops it in a CheckpointException; Ctrl-C or SIGTERM there must stay an interrupt
    (the caller says how to resume), not become 'writing checkpoint failed'. No torn folder is left."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from gqakit.common.atomic import Terminated
    from gqakit.uptrain.run import checkpoints

    def stopped(*args, **kwargs):
        raise CheckpointException("save failed", {0: (Terminated(), None)})

    monkeypatch.setattr(dcp, "save", stopped)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(Terminated):
        checkpoints.save_checkpoint(tmp_path, 3, model=model, optimizer=optimizer, trainer_state={}, rank_state={},
                                    rank=0, recipe={}, is_main=True, barrier=lambda: None, keep=2)
    assert not any((tmp_path / "checkpoints").iterdir())


def _signalled_save(then_fail: bool):
    """A stand-in for dcp.save that receives SIGTERM midway, as torch's C++ writer does when a stop lands
    inside one of its Python callbacks: the exception raised there comes back as an unrelated RuntimeError."""
    def save(tensors, storage_writer, no_dist):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            Path(storage_writer.path).mkdir(parents=True, exist_ok=True)
            (Path(storage_writer.path) / "data").write_bytes(b"x")
        except KeyboardInterrupt:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None
        if then_fail:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    return save


@pytest.mark.parametrize("then_fail", [False, True], ids=["write-completes", "write-fails"])
def test_sigterm_during_a_checkpoint_write_is_a_stop(tmp_path, monkeypatch, then_fail):
    """CI caught SIGTERM landing inside DCP's C++ writer: the stop came back as 'writing checkpoint failed',
    exit 2. A stop is held until the write ends: a write that completes is published (the newest checkpoint
    is kept), one that fails leaves no torn folder; either way the interrupt is what propagates."""
    import torch
    import torch.distributed.checkpoint as dcp

    from gqakit.common.atomic import Terminated, sigterm_as_interrupt
    from gqakit.uptrain.run import checkpoints

    monkeypatch.setattr(dcp, "save", _signalled_save(then_fail))
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    with sigterm_as_interrupt(), pytest.raises(Terminated):
        checkpoints.save_checkpoint(tmp_path, 3, model=model, optimizer=optimizer, trainer_state={}, rank_state={},
                                    rank=0, recipe={}, is_main=True, barrier=lambda: None, keep=2)
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ([] if then_fail else ["step-000003"])

"""Every command in a ```bash block of README.md and of the pages under docs/ runs, in order (PAGES: the
README first, then the pages in an order where each command's inputs exist before it runs), on a copy of
the clone (with tiny budgets), so the documentation cannot drift from the code. Synopses with
placeholders live in plain ``` blocks instead. Commands that need `../shared` run only where it exists;
the few that are not run here are listed in NOT_RUN with the reason.

Each command that writes an uptraining run names its own output_dir, so the commands also work when a
reader follows them literally in order (a folder that holds a finished run is refused): no `force=true`
is appended to hide a clash.

Commands run side by side (one thread each, as many as the machine has cores, up to 4) where the order allows:
a command waits for every earlier one that writes a path it names, that names a path it writes, or that writes
what it writes; a command whose outputs cannot be told from its words (training, the set-up scripts) runs
alone, after everything before it and before everything after it (`dependencies`).

`gqakit` and `convert-gqa` in a command are forked from a server that imported torch and transformers once
(tests/support/fork_cli.py, tested in tests/test_fork_cli.py): the commands run through the shell as written, with
the real entry points, without paying about 4 s of imports each; a command whose environment differs from the
server's runs the real console script. The console scripts themselves run in tests/test_cli.py and the signal tests."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fork_cli import serving

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
# The pages whose ```bash blocks run, in this order: docs/uptrain.md trains the model that the README's
# convert-gqa writes, docs/evaluate.md reads it, the results pages follow in the order of the front page's
# index (docs/results/smollm2-mqa.md makes the SmolLM2 checkpoint that transfer.md and long-context.md read),
# and docs/results/reference-models.md rebuilds the embedded model last.
PAGES = ("README.md", "docs/convert.md", "docs/attention.md", "docs/uptrain.md", "docs/evaluate.md",
         "docs/results.md", "docs/results/conversion.md", "docs/results/gqa-paper.md", "docs/results/uptrain-scale.md",
         "docs/results/smollm2-mqa.md", "docs/results/transfer.md", "docs/results/kv-bytes.md",
         "docs/results/latent.md", "docs/results/decoding.md", "docs/results/long-context.md",
         "docs/results/convert-speed.md",
         "docs/results/merge-memory.md", "docs/results/attention-kernels.md", "docs/results/gpu.md",
         "docs/results/from-the-tests.md",
         "docs/results/plan-startup.md", "docs/results/reference-models.md", "docs/architecture.md")

# Given to a command in place of its own values (`tiny`) so it runs in seconds.
TINY = [
    (r"^gqakit demo", "--eval-tokens 256"),
    # two steps leave no held-out score before the last, so a documented --transfer-patience could never act
    (r"^convert-gqa .*--method transfer .*--transfer-patience",
     "--calibration-tokens 1024 --calibration-window 128 --transfer-steps 2 --transfer-patience 0"),
    (r"^convert-gqa .*--method transfer", "--calibration-tokens 1024 --calibration-window 128 --transfer-steps 2"),
    (r"^convert-gqa .*--calibration ", "--calibration-tokens 1024 --calibration-window 128"),
    (r"^convert-gqa .*--method fit", "--calibration-tokens 1024 --calibration-window 128"),
    (r"gqakit(\.cli)? uptrain .*--plan", ""),
    (r"gqakit(\.cli)? uptrain recipes/uptrain_smollm2", "steps=1 seq_len=32 batch_size=1 eval_sequences=1 "
                                                       "gradient_accumulation_steps=1"),
    (r"gqakit(\.cli)? uptrain", "steps=2 seq_len=64 batch_size=1 eval_sequences=2 eval_every=0 "
                                "gradient_accumulation_steps=1"),
    (r"^gqakit generate", "--max-new-tokens 8"),
    (r"^gqakit sample", "--tokens 2048 --length 128"),
    (r"^gqakit eval ppl", "--max-tokens 256 --max-length 128"),
    (r"^gqakit eval stream", "--tokens 512 --chunk 128"),
    (r"^gqakit eval passkey", "--trials 1 --depths 0.5"),
    (r"^gqakit eval niah", "--samples 1 --depths 0.5 --lengths 256"),
    (r"^python benchmarks/kv_tradeoff.py", "--max-tokens 256 --max-length 128"),
    # a shorter held-out text may not replace the shipped one (refused: it is not this recipe's text)
    (r"^python -m gqakit.reference.train", "steps=2 eval_every=1 log_every=1 seq_len=64 batch_size=2 "
                                           "warmup_steps=1 heldout_chars=20000 heldout_output=heldout-tiny.txt"),
]
NOT_RUN = {  # command prefix -> why this test does not run it
    "pip install": "the set-up itself: CI's install step runs it",
    "python -m venv": "the set-up itself: the test runs in the environment CI installed",
    ". .venv/bin/activate": "the set-up itself: the test runs in the environment CI installed",
    "python -m pytest": "the test suite itself",
    "accelerate launch --multi_gpu": "needs GPUs; the same run on CPU is the torchrun line beside it",
}


def readme_commands(text: str) -> list[str]:
    """The commands of every ```bash block, continuation lines joined and comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = re.split(r"\s+#", line)[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def page_commands() -> list[tuple[str, str]]:
    """(page, command) for every ```bash command of every page in PAGES, in order."""
    return [(page, command) for page in PAGES for command in readme_commands((REPO / page).read_text())]


def tiny(command: str) -> str:
    """`command` with its TINY budget: each flag or key=value of the budget replaces the command's own, if it gives
    one (a flag given twice is refused, as is a key overridden twice)."""
    for pattern, extra in TINY:
        if re.search(pattern, command):
            for flag in re.findall(r"(?<!\S)(--[\w-]+)(?=\s|$)", extra):
                command = re.sub(rf"(?<!\S){re.escape(flag)}(?:=|\s+)\S+", "", command)
            for key in re.findall(r"(?<!\S)([\w.]+)=", extra):
                command = re.sub(rf"(?<!\S){re.escape(key)}=\S+", "", command)
            return f"{command.rstrip()} {extra}".strip()
    return command


def test_every_docs_page_is_run():
    """A new page under docs/ joins PAGES (in an order where its commands' inputs exist), or its commands
    would never run."""
    pages = {str(p.relative_to(REPO)) for p in [*(REPO / "docs").glob("*.md"), *(REPO / "docs/results").glob("*.md")]}
    listed = set(PAGES) - {"README.md"}
    assert pages == listed, f"docs pages missing from PAGES, or PAGES naming no page: {sorted(pages ^ listed)}"


def _output_folder(command: str) -> str | None:
    """The folder a documented command writes: convert-gqa's -o, or an uptraining run's output_dir (the
    recipe's unless overridden)."""
    if re.match(r"(gqakit convert|convert-gqa) ", command) and "--dry-run" not in command:
        found = re.search(r"(?:-o|--output)\s+(\S+)", command)
        return found.group(1) if found else None
    if re.search(r"gqakit(\.cli)? uptrain ", command) and "--plan" not in command:
        found = re.search(r"\boutput_dir=(\S+)", command)
        if found:
            return found.group(1)
        recipe = re.search(r"(recipes/\S+\.yaml)", command)
        text = (REPO / recipe.group(1)).read_text() if recipe else ""
        found = re.search(r"^output_dir:\s*(\S+)", text, re.M)
        return found.group(1) if found else None
    return None


def test_no_two_commands_write_one_folder():
    """Followed literally and in order, the documented commands must not collide: a second convert-gqa
    into one folder is refused without --force, and so is an uptraining run into a folder that holds a
    finished run."""
    seen: dict[str, str] = {}
    for page, command in page_commands():
        folder = _output_folder(command)
        if folder is None:
            continue
        assert folder not in seen, f"{page}: {command}\n  writes {folder}, as does {seen[folder]}"
        seen[folder] = f"{page}: {command}"


def test_ci_runs_the_readmes_test_command():
    """CI (.ci/run) runs the test command that README.md gives: the two cannot drift apart."""
    readme = [c for c in readme_commands((REPO / "README.md").read_text()) if c.startswith("python -m pytest")]
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip().startswith("python -m pytest")]
    assert len(readme) == 1 and ci == readme, (readme, ci)


def test_readme_has_no_placeholders_in_bash_blocks():
    for page, command in page_commands():
        assert not re.search(r"\b(MODEL|RECIPE|FILE|DIR)\b|\[--", command), \
            f"a synopsis in a bash block of {page}: {command}"


@pytest.mark.slow
def test_every_readme_command_runs(tmp_path):
    clone = tmp_path / "clone"
    clone.mkdir()
    for name in ("gqakit", "recipes", "docs", "benchmarks"):
        shutil.copytree(REPO / name, clone / name, ignore=shutil.ignore_patterns("__pycache__"))
    if SHARED.is_dir():
        (tmp_path / "shared").symlink_to(SHARED)  # ../shared, as beside the real clone
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(clone),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "GQAKIT_CACHE_DIR": str(tmp_path / "token-caches"), "HF_HUB_OFFLINE": "1"}
    failed, ran, skipped, jobs = [], [], [], []
    for page, command in page_commands():
        reason = next((why for prefix, why in NOT_RUN.items() if command.startswith(prefix)), None)
        if reason is None and "../shared" in command + _recipe_text(clone, command) and not SHARED.is_dir():
            reason = "needs ../shared"
        if reason is None and "smollm2" in command and not SHARED.is_dir():
            reason = "uses the SmolLM2 checkpoint made from ../shared"
        if reason:
            skipped.append(f"{page}: {command}  [{reason}]")
            continue
        run = tiny(command).replace("python ", f"{sys.executable} ", 1) if command.startswith("python ") \
            else tiny(command)
        jobs.append((page, command, run))
    deps = dependencies([command for _, command, _ in jobs],
                        [command + "\n" + _recipe_text(clone, command) for _, command, _ in jobs])
    workers = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()))
    with serving(env, tmp_path) as env:  # `gqakit` / `convert-gqa` forked from one import of torch (see fork_cli)
        results = run_side_by_side([run for _, _, run in jobs], deps, workers, cwd=clone, env=env)
    for (page, command, run), (code, seconds, err) in zip(jobs, results):
        ran.append(f"{seconds:5.1f} s  {page}: {command}")
        if code:
            failed.append(f"{page}: {run}\n  exit {code}: {err.strip()[-1500:]}")
    real = [line for line in (tmp_path / "fork-cli.log").read_text().splitlines() if not line.startswith("served")]
    print("ran:", *ran, "not run:", *skipped, "console scripts not forked:", *real, sep="\n  ")
    assert not failed, "documented commands that fail:\n" + "\n".join(failed)
    assert len(ran) >= 15  # the embedded-model commands at least


# What a command writes, by its first words: "-o" its -o / --output / --output-dir value (None without one), "" nothing
# (or names no later command can guess: `gqakit eval` without -o picks a free runs/eval-<kind>-<time>), or a flag.
WRITES = [
    (r"^(convert-gqa|gqakit convert) .*--dry-run", ""),
    (r"^(convert-gqa|gqakit convert|gqakit sample|gqakit tokenize) ", "-o"),
    (r"^gqakit eval ", "-o or nothing"),
    (r"^gqakit generate ", ""),
    (r"^python -m gqakit.uptrain.run.metrics ", "-o"),
    (r"^python benchmarks/paired.py ", ""),
    (r"^python benchmarks/kv_tradeoff.py ", "--plot --keep"),
    (r"^(tail|head|cat) ", ""),  # only its redirection, if any
    (r"^cp ", "last"),
]


def writes(command: str) -> set[str] | None:
    """The paths `command` writes, as it spells them; None when its words do not tell (then it runs alone): an
    unknown program, shell operators other than one plain `>`, or an output given as --output=X or -oX."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)  # shell operators apart, even unspaced
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError:  # unbalanced quotes: let the shell say so, alone
        return None
    if (any(re.fullmatch(r"[|&;<>()]+", w) and w != ">" for w in words) or words.count(">") > 1
            or any(re.match(r"(--output(-dir)?=|-o.)", w) for w in words)):
        return None
    written = set()
    if ">" in words:  # a redirection: the file after it
        written.add(words[words.index(">") + 1])
        words = words[:words.index(">")]
    rule = next((how for pattern, how in WRITES if re.search(pattern, command)), None)
    if rule is None:
        return None
    if rule == "last":
        return {w.removeprefix("./") for w in written | {words[-1]}}
    flags = {"-o", "--output", "--output-dir"} if rule.startswith("-o") else set(rule.split())
    named = {words[i + 1] for i, w in enumerate(words[:-1]) if w in flags}
    if rule == "-o" and not named:
        return None  # a default output name, next to its input
    return {w.removeprefix("./") for w in written | named}


def names(text: str, path: str) -> bool:
    """Does `text` name `path` (or something inside it), with or without a leading ./?"""
    return re.search(rf"(?<![\w./-])(\./)?{re.escape(path.rstrip('/'))}(?![\w.-])", text) is not None


def dependencies(commands: list[str], texts: list[str]) -> list[set[int]]:
    """For each command, the earlier ones it must wait for (`texts`: each command with its recipe's text)."""
    out = [writes(c) for c in commands]
    deps = []
    for i, text in enumerate(texts):
        deps.append({j for j in range(i) if out[i] is None or out[j] is None
                     or any(names(text, w) for w in out[j]) or any(names(texts[j], w) for w in out[i])
                     or out[i] & out[j]})
    return deps


def run_side_by_side(jobs: list[str], deps: list[set[int]], workers: int, timeout: float = 900,
                     **popen) -> list[tuple[int, float, str]]:
    """Run the shell commands `jobs` (each after its `deps`, at most `workers` at once); per job its exit status,
    seconds and stderr, in the jobs' order. A job past `timeout` seconds is killed with everything it started
    (status -9), as is every job still running if this function fails."""
    done: dict[int, tuple[int, float, str]] = {}
    running: dict[int, tuple[subprocess.Popen, float, object]] = {}
    pending = list(range(len(jobs)))
    try:
        while pending or running:
            for i in [i for i in pending if deps[i] <= done.keys()][:max(0, workers - len(running))]:
                pending.remove(i)
                err = tempfile.TemporaryFile(mode="w+")
                running[i] = (subprocess.Popen(jobs[i], shell=True, stdout=subprocess.DEVNULL, stderr=err,
                                               start_new_session=True, **popen), time.perf_counter(), err)
            time.sleep(0.05)
            for i, (proc, start, err) in list(running.items()):
                if proc.poll() is None and time.perf_counter() - start > timeout:
                    _kill_group(proc)
                if proc.poll() is not None:
                    err.seek(0)
                    done[i] = (proc.returncode, time.perf_counter() - start, err.read())
                    err.close()
                    del running[i]
    finally:
        for proc, _, err in running.values():
            _kill_group(proc)
            err.close()
    return [done[i] for i in range(len(jobs))]


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill a job's shell and everything it started (its own session), and reap the shell."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def test_dependencies_follow_the_paths_commands_name():
    commands = ["convert-gqa --groups 1 runs/a -o runs/b",            # 0
                "gqakit eval ppl runs/b --text t.txt -o runs/b-eval",  # 1: reads 0's output
                "gqakit eval ppl runs/a --text t.txt",                  # 2: writes no name another reads
                "python benchmarks/paired.py runs/b-eval x y",          # 3: reads 1's report
                "convert-gqa --groups 2 runs/a -o runs/bb",             # 4: runs/b is not runs/bb
                "gqakit uptrain recipes/x.yaml",                        # 5: cannot tell: alone
                "tail -n 2 runs/b-evalx > runs/c.txt",                  # 6: after the barrier
                "convert-gqa --groups 1 runs/c.txt -o runs/a"]          # 7: overwrites what 0, 2, 4 read
    deps = dependencies(commands, commands)
    assert deps[:5] == [set(), {0}, set(), {1}, set()]
    assert deps[5] == {0, 1, 2, 3, 4} and deps[6] == {5} and deps[7] == {0, 2, 4, 5, 6}
    assert writes(commands[2]) == set() and writes(commands[6]) == {"runs/c.txt"} and writes(commands[5]) is None
    for unclear in ("gqakit eval ppl runs/b --text t.txt --output=runs/d", "gqakit eval ppl runs/b -oruns/d",
                    "tail -n 2 t.txt >> runs/d", "tail t.txt | tee runs/d", "cp a b && cp b c", "tail 'a > b",
                    "tail t.txt 2>&1 >runs/d", "cp a b;cp b c"):
        assert writes(unclear) is None, unclear
    assert writes("cp t.txt ./runs/e") == {"runs/e"} and names("gqakit eval ppl ./runs/e", "runs/e")
    assert writes("tail t.txt >runs/f") == {"runs/f"}


def test_side_by_side_keeps_the_order_that_matters(tmp_path):
    """Job 1 reads what job 0 writes after a pause; job 2 is free and finishes first."""
    jobs = ["sleep 0.5 && echo a > first.txt", "cat first.txt >&2", "echo free >&2", "exit 3"]
    results = run_side_by_side(jobs, [set(), {0}, set(), set()], 2, cwd=tmp_path)
    assert [(code, err.strip()) for code, _, err in results] == [(0, ""), (0, "a"), (0, "free"), (3, "")]


def test_a_killed_job_takes_what_it_started_with_it(tmp_path):
    """Past its time a job's shell and the program it started both go (status -9), not the shell alone."""
    [(code, _, _)] = run_side_by_side(["sleep 60 & echo $! > pid; wait"], [set()], 1, timeout=1, cwd=tmp_path)
    pid = int((tmp_path / "pid").read_text())
    stat = Path(f"/proc/{pid}/stat")
    for _ in range(100):  # killed at once; a zombie waits for its new parent to reap it
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the job's child {pid} outlived the kill")
    assert code == -9


def _recipe_text(clone: Path, command: str) -> str:
    """The recipe a command names, without its comments: the data paths it reads."""
    found = re.search(r"(recipes/\S+\.yaml)", command)
    if not (found and (clone / found.group(1)).is_file()):
        return ""
    return "\n".join(line.split("#")[0] for line in (clone / found.group(1)).read_text().splitlines())


def test_the_shipped_training_text_keeps_emma_held_out():
    """recipes/uptrain_embedded.yaml trains on the shipped Pride and Prejudice; no paragraph of the
    held-out Emma may appear in it."""
    train = (REPO / "gqakit/assets/pride_and_prejudice.txt").read_text(encoding="utf-8")
    heldout = (REPO / "gqakit/assets/heldout_emma.txt").read_text(encoding="utf-8")
    paragraphs = [p.strip() for p in heldout.split("\n\n") if len(p.strip()) > 200]
    assert len(paragraphs) > 50 and not any(p in train for p in paragraphs)
    assert "gqakit/assets/pride_and_prejudice.txt" in (REPO / "recipes/uptrain_embedded.yaml").read_text()

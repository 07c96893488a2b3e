"""The fork server that the documented-commands test runs `gqakit` and `convert-gqa` through
(tests/support/fork_cli.py) behaves as the real console scripts: same output and exit status, the shell's
redirections, a fallback to the real script when the environment differs, and a killed command's child killed."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from cli_contract import console_script
from fork_cli import serving
from test_readme_commands import run_side_by_side

TEST_ENTRY = {"gqakit": "fork_cli:_test_entry"}


def shell(command: str, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(command, shell=True, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.fixture
def base_env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def test_served_commands_say_what_the_real_scripts_say(tmp_path, base_env):
    commands = ["convert-gqa --help", "gqakit --version", "gqakit eval ppl --no-such-flag",
                "convert-gqa --groups 2 no-such-folder -o out", "gqakit --version > version.txt && cat version.txt",
                "convert-gqa --help | head -2", "convert-gqa --groups 2 \"$(printf 'caf\\351')\" -o out"]
    real = [shell(c.replace("gqakit", console_script("gqakit"), 1).replace(
                "convert-gqa", console_script("convert-gqa"), 1), base_env, tmp_path) for c in commands]
    with serving(base_env, tmp_path) as env:
        served = [shell(c, env, tmp_path) for c in commands]
    for command, a, b in zip(commands, real, served):
        assert (b.returncode, b.stdout, b.stderr) == (a.returncode, a.stdout, a.stderr), command
    assert [r.returncode for r in served] == [0, 0, 2, 2, 0, 0, 2] and served[4].stdout.startswith("gqakit ")


def test_the_child_runs_in_the_server_unless_the_environment_differs(tmp_path, base_env):
    with serving(base_env, tmp_path, TEST_ENTRY) as env:
        done = shell("gqakit pids 0 3 > out.txt", env, tmp_path)
        assert done.returncode == 3 and done.stderr == "err\n" and (tmp_path / "out.txt").read_text() == "out\n"
        pid, parent, _ = map(int, (tmp_path / "pids").read_text().split())
        server_argv = Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0")
        assert server_argv[1].endswith(b"support/fork_cli.py")  # forked by the server, not started by the shell
        fallback = shell("SOMETHING_NEW=1 gqakit --version", env, tmp_path)  # the real gqakit, not the test entry
        assert fallback.returncode == 0 and fallback.stdout.startswith("gqakit ")
    assert (tmp_path / "fork-cli.log").read_text().splitlines() == [
        "served gqakit pids 0 3", "real gqakit --version: its environment differs in SOMETHING_NEW"]


def test_a_killed_command_takes_its_child_with_it(tmp_path, base_env):
    """A job killed past its time (its client and shell) takes the served command and what that started with it."""
    with serving(base_env, tmp_path, TEST_ENTRY) as env:
        [(code, _, _)] = run_side_by_side(["gqakit pids 60 0"], [set()], 1, timeout=2, cwd=tmp_path, env=env)
        assert code == -9
        pid, _, sleep = map(int, (tmp_path / "pids").read_text().split())
        for _ in range(100):  # killed at once; a zombie waits for its new parent to reap it
            if all(not Path(f"/proc/{p}/stat").exists()
                   or Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z" for p in (pid, sleep)):
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"the served command {pid} or its child {sleep} outlived the killed client")

"""The fork server that the documented-commands test runs `gqakit` and `convert-gqa` through
(tests/support/fork_cli.py) behaves as the real console scripts: same output and exit status, the shell's
redirections, a fallback to the real script when the environment differs, and a killed command's child killed."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_contract import console_script
from fork_cli import client as fork_client, serving
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


ALL_REDUCE = r"""import os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
sys.stdout.write(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}: {total.item()} {sys.argv[1:]} {__name__}\n")
dist.destroy_process_group()
sys.exit(int(sys.argv[1]) * int(os.environ["RANK"]))  # rank 1 exits with the code given
"""


def test_torchrun_and_its_workers_are_served_as_the_real_ones_run(tmp_path, base_env):
    """torchrun forked from the server starts its workers (`python -u SCRIPT`) through the server too, with
    torchrun's own variables per rank; output and exit status as with the real torchrun."""
    (tmp_path / "w.py").write_text(ALL_REDUCE)
    command = "torchrun --nproc_per_node 2 --standalone w.py {code}"
    real = [shell(command.format(code=code).replace("torchrun", console_script("torchrun"), 1), base_env, tmp_path)
            for code in (0, 3)]
    with serving(base_env, tmp_path) as env:
        served = [shell(command.format(code=code), env, tmp_path) for code in (0, 3)]
    lines = [sorted(run.stdout.splitlines()) for run in (*real, *served)]
    assert lines[0] == lines[2] == ["rank 0 of 2: 3.0 ['0'] __main__", "rank 1 of 2: 3.0 ['0'] __main__"], lines
    assert lines[1] == lines[3] and [run.returncode for run in (*real, *served)] == [0, 1, 0, 1]
    assert "exitcode  : 3" in served[1].stderr and "exitcode  : 3" in real[1].stderr
    log = (tmp_path / "fork-cli.log").read_text().splitlines()
    assert sorted(log) == sorted(["served torchrun --nproc_per_node 2 --standalone w.py 0",
                                  "served torchrun --nproc_per_node 2 --standalone w.py 3",
                                  *["served python-worker -u w.py 0"] * 2, *["served python-worker -u w.py 3"] * 2])


def test_a_served_worker_gets_the_signals_its_client_is_sent(tmp_path, base_env):
    """torchrun stops a worker with SIGTERM: the served command gets it, and the client exits with its status."""
    (tmp_path / "w.py").write_text("import pathlib, signal, sys, time\n"
                                   "signal.signal(signal.SIGTERM, lambda *_: (print('stopped'), sys.exit(7)))\n"
                                   "pathlib.Path('ready').write_text('')\n"
                                   "time.sleep(60)\n")
    with serving(base_env, tmp_path) as env:
        client = subprocess.Popen([fork_client(env, "python-worker"), "-u", "w.py"],
                                  cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(600):
            if (tmp_path / "ready").exists():
                break
            time.sleep(0.05)
        client.terminate()
        out, _ = client.communicate(timeout=30)
        other = shell("python-worker -c 'print(1)'", env, tmp_path)  # a flag it does not serve: the real python
        module = shell("python-worker -u -m gqakit.cli --version", env, tmp_path)
    real = shell(f"{sys.executable} -u -m gqakit.cli --version", base_env, tmp_path)
    assert (client.returncode, out) == (7, "stopped\n")
    assert other.returncode == 0 and other.stdout == "1\n"
    assert (module.returncode, module.stdout, module.stderr) == (real.returncode, real.stdout, real.stderr) == (
        0, real.stdout, "")  # no runpy warning that the server had imported gqakit.cli
    log = (tmp_path / "fork-cli.log").read_text().splitlines()
    assert log[1].startswith("real python-worker -c print(1): ")
    assert log[2] == "served python-worker -u -m gqakit.cli --version"


def test_one_server_per_environment_and_only_the_most_recent_kept(base_env, monkeypatch):
    """fork_cli.shared: PYTEST_CURRENT_TEST (new in every test) starts no new server; past MOST_SERVERS
    environments the least recently used server stops (its clients then run the real programs)."""
    import fork_cli

    monkeypatch.setattr(fork_cli, "MOST_SERVERS", 1)
    monkeypatch.setattr(fork_cli, "_SHARED", {})
    first = fork_cli.shared({**base_env, "PYTEST_CURRENT_TEST": "a"})
    assert fork_cli.shared({**base_env, "PYTEST_CURRENT_TEST": "b"}) is first and "PYTEST_CURRENT_TEST" not in first
    clients = Path(fork_cli.client(first, "gqakit")).parent
    second = fork_cli.shared({**base_env, "OTHER": "1"})
    assert second is not first and not clients.exists() and len(fork_cli._SHARED) == 1
    fork_cli._stop_all()
    assert not Path(fork_cli.client(second, "gqakit")).parent.exists()


def test_a_served_worker_killed_by_a_signal_looks_so_and_kept_what_it_wrote(tmp_path, base_env):
    """As `python -u`: the output written before a SIGKILL is kept (unbuffered), and the client dies by the same
    signal (torchrun reports `Signal 9`, not an exit code)."""
    (tmp_path / "w.py").write_text("import os, signal\nprint('before')\nos.kill(os.getpid(), signal.SIGKILL)\n")
    env = {k: v for k, v in base_env.items() if k != "PYTHONUNBUFFERED"}  # -u itself must do it
    real = subprocess.run([sys.executable, "-u", "w.py"], cwd=tmp_path, env=env, capture_output=True, text=True)
    with serving(env, tmp_path) as served_env:
        served = subprocess.run(["python-worker", "-u", "w.py"], cwd=tmp_path, env=served_env, capture_output=True,
                                text=True)
    assert (served.returncode, served.stdout) == (real.returncode, real.stdout) == (-9, "before\n"), served.stderr
    assert (tmp_path / "fork-cli.log").read_text() == "served python-worker -u w.py\n"

"""The console scripts `gqakit` and `convert-gqa` served from one process that imported torch and transformers once.

For the documented-commands test, where about 4 s of every command is that import. Each command still runs through
the shell as written; `gqakit ...` in it finds a small client first on PATH, which hands its arguments, working
folder, environment and standard streams (the file descriptors themselves) to the server and exits with the status
the server sends back. The server forks; the child takes the streams, folder and environment, sets sys.argv as the
console script has it, calls the entry point the console script calls (`gqakit.cli:main`, `...:convert_main`), runs
the exit handlers and exits with the status `sys.exit(main())` would give.

A forked child is not a fresh interpreter, so the differences are kept from mattering:
- an environment that differs from the server's in anything but the shell's own variables (a variable read at
  import time, such as OMP_NUM_THREADS or HF_HUB_OFFLINE, would be stale) makes the client run the real script;
- so does a server that is not there;
- the server imports third-party modules only (torch, transformers, accelerate, ...) and `gqakit.cli`, which the
  console script imports first anyway; the rest of gqakit is imported by the command itself, as in a fresh process;
- the server never runs a tensor operation and stays single-threaded, so the fork copies no thread pool or lock;
  it sets no signal handler, so the child's are a fresh interpreter's (SIGPIPE ignored, SIGINT a KeyboardInterrupt);
- a client that dies (a timed-out job killed with its process group) takes its child with it: the server sees the
  socket close and kills the child's process group (the child starts one of its own, so what it started goes too).

    with serving(env, tmp_path) as env:   # PATH now finds the clients
        subprocess.run("gqakit eval ppl ... > out.txt", shell=True, env=env)
"""
from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

ENTRIES = {"gqakit": "gqakit.cli:main", "convert-gqa": "gqakit.cli:convert_main"}
PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "transformers.generation", "accelerate",
           "safetensors.torch", "datasets", "matplotlib.pyplot", "yaml", "tqdm.auto")
SHELL_OWN = {"PWD", "OLDPWD", "SHLVL", "_"}  # what a shell sets in a command's environment by itself
CLIENT = '''#!{python}
import json, os, socket, sys
real = {real!r}
try:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect({socket!r})
    socket.send_fds(s, [json.dumps({{"args": sys.argv[1:], "real": real, "cwd": os.getcwd(),
                                     "env": dict(os.environ)}}).encode()], [0, 1, 2])
    reply = s.recv(64)
except OSError:
    reply = b"exec"
if reply == b"exec":
    os.execv(real, [real, *sys.argv[1:]])
sys.exit(int(reply) if reply else "fork_cli: the server went away during the command")
'''


def _exit_status(entry) -> int:
    """The status `sys.exit(entry())` gives a console script."""
    try:
        code = entry()
    except SystemExit as stop:
        code = stop.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _child(request: dict, fds: list[int], entry, inherited: list[socket.socket]) -> None:
    """In the forked child: become the command, run it, exit. Never returns."""
    code = 1
    try:
        for s in inherited:
            s.close()
        os.setsid()  # a group of its own, so that what it starts is killed with it
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        for name in SHELL_OWN:  # the rest equals the server's own (else the client ran the real script), with
            os.environ.pop(name, None)  # what the imports added to it, as in a fresh process
        os.environ.update({k: v for k, v in request["env"].items() if k in SHELL_OWN})
        sys.argv = [request["real"], *request["args"]]
        sys.path[0] = os.path.dirname(request["real"])
        code = _exit_status(entry)
        for thread in threading.enumerate():  # as the interpreter does at exit: wait for non-daemon threads
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - a fresh interpreter prints the traceback and exits 1
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _same_environment(theirs: dict, ours: dict) -> bool:
    strip = lambda env: {k: v for k, v in env.items() if k not in SHELL_OWN}  # noqa: E731
    return strip(theirs) == strip(ours)


def _why_not(request: dict, fds: list[int], loaded: dict, ours: dict) -> str | None:
    """Why this request runs the real console script, or None when it is served."""
    name = os.path.basename(request["real"])
    if name not in loaded or len(fds) != 3:
        return f"{name} is not served here" if name not in loaded else "no standard streams came"
    if not _same_environment(request["env"], ours):
        theirs = {k: v for k, v in request["env"].items() if k not in SHELL_OWN}
        return "its environment differs in " + ", ".join(
            sorted(k for k in (theirs.keys() | ours.keys()) - SHELL_OWN if theirs.get(k) != ours.get(k)))
    return None


def serve(path: str, entries: dict[str, str], log: str) -> None:
    """Listen on the Unix socket `path` until standard input closes; one forked child per request, and a line per
    request in the file `log` (served, or why the real script ran)."""
    ours = dict(os.environ)  # before the imports, which may add to it (transformers: TORCHINDUCTOR_CACHE_DIR)
    loaded = {}
    for name, spec in entries.items():
        module, function = spec.split(":")
        loaded[name] = getattr(importlib.import_module(module), function)
    for module in PRELOAD:
        importlib.import_module(module)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([0, listener, *children.values()], [], [], 0.05)
        if 0 in ready and not os.read(0, 4096):
            break
        if listener in ready:
            conn, _ = listener.accept()
            fds = []
            try:
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                request = json.loads(message)
                name, why = os.path.basename(request["real"]), _why_not(request, fds, loaded, ours)
                said = f"{name} {' '.join(request['args'])}"
            except Exception as err:  # noqa: BLE001 - a request it cannot read runs the real script
                why, said = f"the server could not read the request ({err!r})", "?"
            with open(log, "a", encoding="utf-8", errors="backslashreplace") as out:
                out.write(f"served {said}\n" if why is None else f"real {said}: {why}\n")
            if why is not None:
                conn.send(b"exec")
                conn.close()
            else:
                pid = os.fork()
                if pid == 0:
                    _child(request, fds, loaded[name], [listener, conn, *children.values()])
                children[pid] = conn
            for fd in fds:
                os.close(fd)
        for pid, conn in list(children.items()):
            if conn in ready:  # the client went away (killed): so does its command, with what it started
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                with contextlib.suppress(OSError):  # killed by signal n: the shell's 128 + n
                    conn.send(str(code if code >= 0 else 128 - code).encode())
                conn.close()
                del children[pid]
    for pid in children:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def real_script(name: str) -> str:
    """The installed console script `name` (gqakit, convert-gqa) of the Python running the tests."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    assert found, f"console script {name} is not installed; pip install -e . first"
    return found


@contextlib.contextmanager
def serving(env: dict, folder: Path, entries: dict[str, str] = ENTRIES):
    """Start the server with `env` (plus the clients' folder first on PATH); yield that environment. The server
    writes a line per command to `folder`/fork-cli.log: served, or why the real script ran."""
    bin_dir = folder / "fork-cli-bin"
    bin_dir.mkdir()
    short = tempfile.mkdtemp(prefix="fork-cli-")  # a socket's path is at most 107 bytes
    sock = os.path.join(short, "sock")
    env = {**env, "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"}
    for name in entries:
        client = bin_dir / name
        client.write_text(CLIENT.format(python=sys.executable, real=real_script(name), socket=sock))
        client.chmod(0o755)
    server = subprocess.Popen([sys.executable, __file__, sock, json.dumps(entries), str(folder / "fork-cli.log")],
                              env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert server.stdout.readline() == b"ready\n", "the fork server did not start"
        yield env
    finally:
        server.stdin.close()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        shutil.rmtree(short, ignore_errors=True)


def _test_entry() -> int:
    """An entry point for the tests: start `sleep argv[2]`, write "pid parent sleep's-pid" to the file argv[1],
    wait for the sleep, print a line to each stream, return argv[3]."""
    sleep = subprocess.Popen(["sleep", sys.argv[2]])
    Path(sys.argv[1]).write_text(f"{os.getpid()} {os.getppid()} {sleep.pid}")
    sleep.wait()
    print("out")
    print("err", file=sys.stderr)
    return int(sys.argv[3])


if __name__ == "__main__":
    serve(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3])

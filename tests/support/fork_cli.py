"""The console scripts `gqakit`, `convert-gqa` and `torchrun`, and torchrun's workers, served from one process that
imported torch and transformers once.

For the documented-commands test, the CLI-contract helper and the multi-process tests, where about 4 s of every
command (and of every torchrun worker) is that import. Each command still runs through
the shell as written; `gqakit ...` in it finds a small client first on PATH, which hands its arguments, working
folder, environment and standard streams (the file descriptors themselves) to the server and exits with the status
the server sends back. The server forks; the child takes the streams, folder and environment, sets sys.argv as the
console script has it, calls the entry point the console script calls (`gqakit.cli:main`, `...:convert_main`), runs
the exit handlers and exits with the status `sys.exit(main())` would give.

torchrun served sets its `sys.executable` to the `python-worker` client, so the workers it starts (`python -u SCRIPT
...` or `python -u -m MODULE ...`) are served too, each run as the interpreter runs a script or a module (runpy),
with torchrun's per-rank variables (RANK, MASTER_PORT, TORCHELASTIC_*, ...: read when a process group starts, never
at import). A served command's client forwards SIGTERM, SIGINT and SIGHUP to it (torchrun stops workers so).

A forked child is not a fresh interpreter, so the differences are kept from mattering:
- an environment that differs from the server's in anything but the shell's and torchrun's own variables (a variable
  read at import time, such as OMP_NUM_THREADS or HF_HUB_OFFLINE, would be stale) makes the client run the real
  program;
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
import io
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

PYTHON = "python"  # the entry that runs `python -u SCRIPT ...` / `python -u -m MODULE ...` (torchrun's workers)
ENTRIES = {"gqakit": "gqakit.cli:main", "convert-gqa": "gqakit.cli:convert_main",
           "torchrun": "torch.distributed.run:main", "python-worker": PYTHON}
PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "transformers.generation", "accelerate",
           "safetensors.torch", "datasets", "matplotlib.pyplot", "yaml", "tqdm.auto", "torch.distributed.run",
           "torch.distributed.fsdp", "transformers.models.llama.modeling_llama")
SHELL_OWN = {"PWD", "OLDPWD", "SHLVL", "_"}  # what a shell sets in a command's environment by itself
# What torchrun tells each worker; read when a process group starts, never at import, so they may differ
LAUNCHER_OWN = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
CLIENT = '''#!{python}
import json, os, signal, socket, sys
real = {real!r}
try:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect({socket!r})
    socket.send_fds(s, [json.dumps({{"name": {name!r}, "args": sys.argv[1:], "real": real, "cwd": os.getcwd(),
                                     "client": os.path.abspath(sys.argv[0]), "env": dict(os.environ)}}).encode()],
                    [0, 1, 2])
    reply = s.recv(64)
except OSError:  # no server: the real program (never once the command has started: it would run twice)
    reply = b"exec"
if reply == b"exec":
    os.execv(real[0], [*real, *sys.argv[1:]])
if not reply.startswith(b"pid "):
    sys.exit("fork_cli: the server went away before the command started")
child = int(reply[4:])  # served: what this process is sent, its command gets (torchrun stops workers so)


def forward(signum, frame):
    try:
        os.kill(child, signum)
    except OSError:  # it has just exited: its status is on its way
        pass


for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(signum, forward)
try:
    reply = s.recv(64)
except OSError:
    reply = b""
if not reply:
    sys.exit("fork_cli: the server went away during the command")
status = int(reply)
if status < 0:  # killed by a signal: so is this process, as the command's parent would see it
    if -status != signal.SIGKILL:
        signal.signal(-status, signal.SIG_DFL)
    os.kill(os.getpid(), -status)
sys.exit(status & 0xFF)
'''


def _launcher_own(name: str) -> bool:
    return name in LAUNCHER_OWN or name.startswith("TORCHELASTIC_")


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
        for name in [*os.environ]:  # the rest equals the server's own (else the client ran the real script), with
            if name in SHELL_OWN or _launcher_own(name):  # what the imports added to it, as in a fresh process
                os.environ.pop(name)
        os.environ.update({k: v for k, v in request["env"].items() if k in SHELL_OWN or _launcher_own(k)})
        if entry == PYTHON:
            entry = _python(request["args"])
        else:
            sys.argv = [request["real"][0], *request["args"]]
            sys.path[0] = os.path.dirname(request["real"][0])
        if request["name"] == "torchrun":  # its workers (`sys.executable -u ...`) are served too
            sys.executable = os.path.join(os.path.dirname(request["client"]), "python-worker")
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


def _python(args: list[str]):
    """The entry point of `python -u SCRIPT ARGS` or `python -u -m MODULE ARGS`, as the interpreter sets them up."""
    import runpy

    for name, fd in (("stdout", 1), ("stderr", 2)):  # -u: text written through to an unbuffered file
        old = getattr(sys, name)
        setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=old.encoding,
                                            errors=old.errors, write_through=True))
    if args[1] == "-m":
        sys.argv, sys.path[0] = [args[2], *args[3:]], os.getcwd()

        def entry() -> None:
            sys.modules.pop(args[2], None)  # as in a fresh `python -m`, where the server's import had not been
            runpy.run_module(args[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv, sys.path[0] = args[1:], os.path.dirname(os.path.abspath(args[1]))

        def entry() -> None:
            runpy.run_path(args[1], run_name="__main__")
    return entry


def _differs(theirs: dict, ours: dict, added: dict) -> list[str]:
    """The variables in which two environments differ, but for the shell's and the launcher's own, and those the
    server's imports `added` (as the command's own imports would), when they hold the same value there."""
    return sorted(k for k in theirs.keys() | ours.keys()
                  if k not in SHELL_OWN and not _launcher_own(k) and theirs.get(k) != ours.get(k)
                  and not (k in added and theirs.get(k) == added[k]))


def _why_not(request: dict, fds: list[int], loaded: dict, ours: dict, added: dict) -> str | None:
    """Why this request runs the real program, or None when it is served."""
    name, args = request["name"], request["args"]
    if name not in loaded or len(fds) != 3:
        return f"{name} is not served here" if name not in loaded else "no standard streams came"
    script_or_module = len(args) >= 2 and (not args[1].startswith("-") or args[1] == "-m" and len(args) >= 3)
    if loaded[name] == PYTHON and not (args[0] == "-u" and script_or_module):
        return "python is served only as `python -u SCRIPT ...` or `python -u -m MODULE ...`"
    differs = _differs(request["env"], ours, added)
    return f"its environment differs in {', '.join(differs)}" if differs else None


def serve(path: str, entries: dict[str, str], log: str) -> None:
    """Listen on the Unix socket `path` until standard input closes; one forked child per request, and a line per
    request in the file `log` (served, or why the real script ran)."""
    ours = dict(os.environ)  # before the imports, which may add to it (transformers: TORCHINDUCTOR_CACHE_DIR)
    loaded = {}
    for name, spec in entries.items():
        if spec == PYTHON:
            loaded[name] = PYTHON
            continue
        module, function = spec.split(":")
        loaded[name] = getattr(importlib.import_module(module), function)
    for module in PRELOAD:
        importlib.import_module(module)
    added = {k: v for k, v in os.environ.items() if k not in ours}  # transformers: TORCHINDUCTOR_CACHE_DIR
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
                name, why = request["name"], _why_not(request, fds, loaded, ours, added)
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
                with contextlib.suppress(OSError):  # the client forwards the signals it is sent
                    conn.send(f"pid {pid}".encode())
                children[pid] = conn
            for fd in fds:
                os.close(fd)
        for pid, conn in list(children.items()):
            if conn in ready:  # the client went away (killed): so does its command, with what it started
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)  # -n: killed by signal n, and the client kills itself so
                with contextlib.suppress(OSError):
                    conn.send(str(code).encode())
                conn.close()
                del children[pid]
    for pid in children:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def real_command(name: str) -> list[str]:
    """What the client runs when it is not served: the console script, or this Python for `python-worker`."""
    return [sys.executable] if ENTRIES.get(name) == PYTHON else [real_script(name)]


def real_script(name: str) -> str:
    """The installed console script `name` (gqakit, convert-gqa, torchrun) of the Python running the tests."""
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
        client.write_text(CLIENT.format(python=sys.executable, name=name, real=real_command(name), socket=sock))
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


_SHARED: dict = {}  # this process's servers, by environment: (the environment each serves, its ExitStack)
MOST_SERVERS = 2  # a server holds ~0.5 GB: past this many environments the least recently used one is stopped
VARIES = {"PYTEST_CURRENT_TEST"}  # changes with every test and is read by no command: left out of the key


def shared(env: dict) -> dict:
    """The environment of this process's server for `env` (less VARIES), started at the first call with it and
    stopped at exit, or when MOST_SERVERS other environments were asked for since. Commands run with the
    environment returned find the clients first on PATH."""
    env = {k: v for k, v in env.items() if k not in VARIES}
    key = json.dumps(sorted(env.items()))
    if key in _SHARED:
        _SHARED[key] = _SHARED.pop(key)  # most recently used last
        return _SHARED[key][0]
    while len(_SHARED) >= MOST_SERVERS:
        _SHARED.pop(next(iter(_SHARED)))[1].close()
    folder = Path(tempfile.mkdtemp(prefix="fork-cli-shared-"))
    stack = contextlib.ExitStack()
    stack.callback(shutil.rmtree, folder, True)  # runs last: the server goes, then its folder
    try:
        _SHARED[key] = (stack.enter_context(serving(env, folder)), stack)
    except BaseException:
        stack.close()
        raise
    return _SHARED[key][0]


def _stop_all() -> None:
    while _SHARED:
        _SHARED.popitem()[1][1].close()


atexit.register(_stop_all)


def torchrun(processes: int, env: dict) -> tuple[list[str], dict]:
    """(argv, environment) for `torchrun --nproc_per_node N --standalone ...` with `env`: the launcher and its
    workers (`python -u ...`) forked from a server that imported torch once, as `gqakit` is (an environment the
    workers change beyond torchrun's own variables runs them as real processes)."""
    served = shared(env)
    return [client(served, "torchrun"), "--nproc_per_node", str(processes), "--standalone"], served


def client(served: dict, name: str) -> str:
    """The client `name` in the environment a server serves (its folder is first on PATH)."""
    return os.path.join(served["PATH"].split(os.pathsep)[0], name)


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

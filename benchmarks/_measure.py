"""What the benchmark scripts share: background load (a co-running process), memory readers (RSS and its
high-water mark from /proc, malloc's bytes in use, a child's own peak at exit, RSS sampled while a call runs),
synthetic checkpoints of a given shape, timing summaries, and the small helpers of their reports.

A script imports it as a sibling module (`from _measure import ...`): run as `python benchmarks/x.py`, the
script's folder is on sys.path. Only the standard library is imported here at load time; torch, safetensors and
gqakit are imported inside the functions that need them, so a driver process stays light until it measures.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import json
import math
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent  # the repository
EMBEDDED = ROOT / "gqakit" / "assets" / "austen-mha-8h"  # the embedded model: its tokenizer serves synthetic models
PRIDE = ROOT / "gqakit" / "assets" / "pride_and_prejudice.txt"  # calibration text of the synthetic conversions
MIB = 2**20


# ---------------------------------------------------------------------------------------------------
# Reports and progress


def logger(tag: str | None = None) -> Callable[[str], None]:
    """A progress printer to stderr (stdout is the report), each line prefixed `[tag]` when a tag is given."""
    prefix = f"[{tag}] " if tag else ""

    def log(msg: str) -> None:
        print(prefix + msg, file=sys.stderr, flush=True)

    return log


def command_line(script: str, argv: list[str] | None) -> str:
    """`python benchmarks/NAME.py ARGS` as the report quotes it (`argv` None: this process's own arguments)."""
    return f"python benchmarks/{Path(script).name}" + "".join(" " + shlex.quote(a) for a in (argv or sys.argv[1:]))


def mib(nbytes: float) -> str:
    """Bytes as MiB for a table cell: 1,392.3."""
    return f"{nbytes / MIB:,.1f}"


def median_p90(times: list[float]) -> tuple[float, float]:
    """The median and the 90th percentile (linear between the samples around it, `statistics.quantiles`'
    inclusive method) of timed steps."""
    if len(times) < 2:
        return times[0], times[0]
    return statistics.median(times), statistics.quantiles(times, n=10, method="inclusive")[8]


def cache_bytes(layers) -> int:
    """Bytes a KV cache holds, read off its layers' key and value tensors (`cache.layers`)."""
    return sum(t.numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values))


def eval_curve(run: Path) -> list[tuple[int, int, float]]:
    """(step, tokens, held-out perplexity) at every evaluation of an uptraining run, from its metrics.csv."""
    import csv

    with (Path(run) / "metrics.csv").open() as f:
        return [(int(r["step"]), int(r["tokens"]), float(r["eval_ppl"])) for r in csv.DictReader(f)
                if r["eval_ppl"] not in ("", None)]


# ---------------------------------------------------------------------------------------------------
# Background load

CO_RUNNER = """
import os, time, torch
torch.set_num_threads(os.cpu_count())
a = torch.randn(1024, 1024)
end = time.time() + 3600
while time.time() < end:
    a @ a
"""


@contextlib.contextmanager
def co_running(settle: float = 2.0):
    """Inside this block a co-running torch process does 1024 x 1024 matmuls on every core (whatever OMP_* says: it
    runs with torch's defaults, not this process's thread settings), as a second job on a shared machine does; it is
    given `settle` seconds first and stopped when the block ends."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_", "MKL_"))}
    co = subprocess.Popen([sys.executable, "-c", CO_RUNNER], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          env=env)
    try:
        time.sleep(settle)
        yield
    finally:
        co.kill()
        co.wait()


BACKGROUND_JOB = "while True: pass"


@contextlib.contextmanager
def background_jobs(count: int = 2, niceness: int = 19, settle: float = 1.0):
    """Inside this block `count` busy loops run at `nice -n niceness`, each in its own session, as low-priority jobs
    of other users do: with the kernel's autogroups on (Linux's default for desktops and many servers), nice orders
    processes within one session only, so such a job still takes its share of a core. Stopped when the block ends."""
    jobs = [subprocess.Popen(["nice", "-n", str(niceness), sys.executable, "-c", BACKGROUND_JOB],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            for _ in range(count)]
    try:
        time.sleep(settle)
        yield
    finally:
        for job in jobs:
            job.kill()
            job.wait()


# ---------------------------------------------------------------------------------------------------
# Memory


def status_kib(key: str, pid: int | str = "self") -> int | None:
    """A field of /proc/PID/status in KiB (VmRSS: resident now; VmHWM: its high-water mark); None once the process
    or the field is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def status_mib(key: str, pid: int | str = "self") -> float:
    """`status_kib` in MiB; NaN where there is no such field."""
    kib = status_kib(key, pid)
    return float("nan") if kib is None else kib / 1024


def rss_mib(pid: int | str = "self") -> float:
    """Resident memory of a process now, MiB (NaN once it has exited)."""
    return status_mib("VmRSS", pid)


def reset_peak() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def maxrss_kib(children: bool = False) -> int:
    """ru_maxrss (Linux: KiB), the high-water mark of this process, or the largest of its waited-for children."""
    return resource.getrusage(resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF).ru_maxrss


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.lru_cache(maxsize=None)
def _mallinfo2():
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2


def malloc_in_use() -> int:
    """Bytes malloc has handed out and not had back (all arenas, plus mmapped chunks); glibc >= 2.33. Unlike RSS it
    leaves out the freed heap glibc keeps."""
    info = _mallinfo2()()
    return info.uordblks + info.hblkhd


def live_peak():
    """A TorchDispatchMode that samples `malloc_in_use()` after every aten op: `top` is the highest it saw, `peak`
    that height above `base`, the level when the mode was entered."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LivePeak(TorchDispatchMode):
        def __enter__(self):
            self.base = self.top = malloc_in_use()
            return super().__enter__()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.top = max(self.top, malloc_in_use())
            return out

        @property
        def peak(self) -> int:
            return self.top - self.base

    return LivePeak()


def sampled_peak(fn: Callable, interval: float = 0.005):
    """(fn(), seconds, peak RSS growth in MiB over the RSS before), the RSS sampled every `interval` seconds."""
    base, peak, done = rss_mib(), [0.0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_mib())
            time.sleep(interval)

    thread = threading.Thread(target=sample)
    thread.start()
    start = time.perf_counter()
    try:
        out = fn()
    finally:
        seconds = time.perf_counter() - start
        done.set()
        thread.join()
    return out, seconds, max(peak[0], rss_mib()) - base


PEAK_FILE = "GQAKIT_PEAK_FILE"
# The converter, run so that it writes its own peak RSS at exit. ru_maxrss (wait4) cannot tell it: Linux
# carries a process's RSS high-water mark across execve, and a forked child starts with its parent's
# address space, so every child reports at least this benchmark's own RSS at the fork (measured here:
# 1,229 MiB for a mean conversion whose own peak is 453 MiB). VmHWM belongs to the exec'd address space.
_CONVERT = ("import atexit, os, sys\n"
            "def _peak():\n"
            f"    path = os.environ.get({PEAK_FILE!r})\n"
            "    if path:\n"
            "        with open('/proc/self/status') as f, open(path, 'w') as out:\n"
            "            out.write(next(line for line in f if line.startswith('VmHWM:')).split()[1])\n"
            "atexit.register(_peak)\n"
            "from gqakit.cli import convert_main\n"
            "sys.exit(convert_main(sys.argv[1:]))\n")


def converter_command() -> list[str]:
    """`convert-gqa` as this interpreter runs it (the console script's own entry point, in one process),
    reporting its peak RSS at exit when run by `run_child`."""
    return [sys.executable, "-c", _CONVERT]


def run_child(cmd: list[str], scratch: Path) -> tuple[float, int]:
    """Run `cmd`, return (wall seconds, the child's own peak RSS in KiB): VmHWM as the converter reports it
    at exit (`converter_command`), else ru_maxrss from wait4 (which includes this process's RSS at the fork)."""
    with tempfile.TemporaryFile(dir=scratch) as out, tempfile.TemporaryDirectory(dir=scratch) as tmp:
        peak_file = Path(tmp) / "peak"
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, PEAK_FILE: str(peak_file)})
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            out.seek(0)
            text = out.read().decode(errors="replace")[-4000:]
            raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}:\n{text}")
        peak = int(peak_file.read_text()) if peak_file.is_file() else usage.ru_maxrss  # Linux: KiB
    return seconds, peak


# ---------------------------------------------------------------------------------------------------
# Synthetic checkpoints


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def label(self, groups: int) -> str:
        return (f"{self.layers}L h{self.hidden} i{self.intermediate} {self.heads}H->{groups}KV "
                f"d{self.head_dim} v{self.vocab}")


PRESETS = {
    "7b": Shape(layers=32, hidden=4096, intermediate=11008, heads=32, vocab=32000),  # Llama-2-7B
    "small": Shape(layers=4, hidden=1024, intermediate=2816, heads=16, vocab=32000),
    "pythia-6.9b": Shape(layers=32, hidden=4096, intermediate=16384, heads=32, vocab=50432),
    "pythia-small": Shape(layers=4, hidden=1024, intermediate=4096, heads=16, vocab=50432),
}

Entries = list[tuple[str, str, tuple[int, ...]]]  # (tensor name, safetensors dtype, shape) in state-dict order


def shape_config(s: Shape) -> dict:
    """The config.json keys every family spells alike."""
    return {"hidden_size": s.hidden, "intermediate_size": s.intermediate, "num_hidden_layers": s.layers,
            "num_attention_heads": s.heads, "vocab_size": s.vocab, "initializer_range": 0.02,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def llama_config(s: Shape) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape_config(s),
        "num_key_value_heads": s.heads, "head_dim": s.head_dim, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2,
    }


def llama_entries(s: Shape) -> Entries:
    """Every tensor of an untied Llama, named as HF names it, in module (state-dict) order."""
    h, i = s.hidden, s.intermediate
    entries = [("model.embed_tokens.weight", "BF16", (s.vocab, h))]
    for n in range(s.layers):
        p = f"model.layers.{n}."
        entries += [
            (p + "self_attn.q_proj.weight", "BF16", (s.heads * s.head_dim, h)),
            (p + "self_attn.k_proj.weight", "BF16", (s.heads * s.head_dim, h)),
            (p + "self_attn.v_proj.weight", "BF16", (s.heads * s.head_dim, h)),
            (p + "self_attn.o_proj.weight", "BF16", (h, s.heads * s.head_dim)),
            (p + "mlp.gate_proj.weight", "BF16", (i, h)),
            (p + "mlp.up_proj.weight", "BF16", (i, h)),
            (p + "mlp.down_proj.weight", "BF16", (h, i)),
            (p + "input_layernorm.weight", "BF16", (h,)),
            (p + "post_attention_layernorm.weight", "BF16", (h,)),
        ]
    entries += [("model.norm.weight", "BF16", (h,)), ("lm_head.weight", "BF16", (s.vocab, h))]
    return entries


def neox_config(s: Shape) -> dict:
    """A Pythia-style config.json (legacy keys, as on the hub): parallel residual, a quarter of each head rotary."""
    return {
        "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", **shape_config(s),
        "max_position_embeddings": 2048, "rotary_pct": 0.25, "rotary_emb_base": 10000,
        "use_parallel_residual": True, "layer_norm_eps": 1e-5, "hidden_act": "gelu", "bos_token_id": 0,
        "eos_token_id": 0,
    }


def neox_entries(s: Shape) -> Entries:
    """Every tensor of an untied GPTNeoXForCausalLM, named as HF names it, in module (state-dict) order."""
    h, i = s.hidden, s.intermediate
    entries = [("gpt_neox.embed_in.weight", "BF16", (s.vocab, h))]
    for n in range(s.layers):
        p = f"gpt_neox.layers.{n}."
        for name, shape in (("input_layernorm", (h,)), ("post_attention_layernorm", (h,)),
                            ("attention.query_key_value", (3 * h, h)),  # rows per head: [q | k | v]
                            ("attention.dense", (h, h)), ("mlp.dense_h_to_4h", (i, h)),
                            ("mlp.dense_4h_to_h", (h, i))):
            entries += [(p + name + ".weight", "BF16", shape), (p + name + ".bias", "BF16", shape[:1])]
    entries += [("gpt_neox.final_layer_norm.weight", "BF16", (h,)), ("gpt_neox.final_layer_norm.bias", "BF16", (h,)),
                ("embed_out.weight", "BF16", (s.vocab, h))]
    return entries


def entries_bytes(entries: Entries) -> int:
    """Bytes of a bf16 checkpoint's tensors."""
    return sum(math.prod(shape) * 2 for _, _, shape in entries)


def pattern(shape: tuple[int, ...], salt: int):
    """A cheap deterministic bf16 fill whose rows (and so heads) differ: row term + column term.

    Built by one broadcast add straight into the bf16 output, so it costs one tensor of memory.
    """
    import torch

    if len(shape) == 1:
        return (1.0 + ((torch.arange(shape[0]) * 7 + salt) % 13) / 64.0).to(torch.bfloat16)
    rows, cols = shape
    row = (((torch.arange(rows) * 37 + salt) % 101) / 101.0 - 0.5).to(torch.bfloat16)
    col = (((torch.arange(cols) * 11 + salt) % 29) / 290.0).to(torch.bfloat16)
    out = torch.empty(shape, dtype=torch.bfloat16)
    torch.add(row.view(-1, 1), col.view(1, -1), out=out)  # (rows, cols)
    return out


def write_checkpoint(folder: Path, config: dict, entries: Entries, max_shard_bytes: int,
                     fill: Callable[[int, tuple[int, ...]], object]) -> None:
    """A model folder: config.json and size-capped safetensors shards with an index, written one tensor at a time
    (`fill(k, shape)` makes the k-th tensor)."""
    from gqakit.hf.checkpoint import ShardWriter

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    writer = ShardWriter(folder, entries, max_shard_bytes)
    for k, (name, _, shape) in enumerate(entries):
        tensor = fill(k, shape)
        writer.write_tensor(name, tensor)
        del tensor
    writer.finish()


def write_random_llama(folder: Path, shape: Shape, max_shard_bytes: int, seed: int = 0) -> None:
    """A bf16 MHA Llama of `shape` with random N(0, 1/in) weights (so that heads differ and activations stay
    finite; norms around 1) and the embedded model's tokenizer, so that it converts with calibration text."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def fill(_k, dims):
        if len(dims) == 1:  # norm weights: around 1
            return (1 + 0.1 * torch.randn(dims, generator=gen)).to(torch.bfloat16)
        return (torch.randn(dims, generator=gen) / math.sqrt(dims[1])).to(torch.bfloat16)

    write_checkpoint(folder, llama_config(shape), llama_entries(shape), max_shard_bytes, fill)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED / name, folder / name)

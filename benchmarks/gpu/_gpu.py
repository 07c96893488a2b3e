"""What the GPU device check's scripts share: the path to the benchmarks they reuse, the device a run uses,
synchronised timing, peak device memory, out-of-memory detection, which SDPA kernel ran, a time budget, and
the JSON each script leaves for benchmarks/gpu/summary.py.

A script here imports it as a sibling module (`from _gpu import ...`): run as `python benchmarks/gpu/x.py`, the
script's folder is on sys.path; importing this module also puts benchmarks/ there, for `_measure`,
`decode_kv_heads` and `uptrain_scale`. torch is imported inside the functions, as in `_measure`.
"""
from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Callable

BENCHMARKS = Path(__file__).resolve().parent.parent
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

# run.sh's time limit interrupts a script with SIGINT, which each script turns into the JSON of what finished; a
# process started with SIGINT ignored (a launcher's background job, a pytest-xdist worker) inherits the ignore, and
# Python then leaves it so: the limit passed unnoticed until the kill. Interrupts are interrupts here, whatever came
# before.
signal.signal(signal.SIGINT, signal.default_int_handler)

GIB = 2**30


def pick_device(dry_run: bool):
    """'cpu' for a dry run, else CUDA, refused in one line where there is none."""
    import torch

    if dry_run:
        torch.set_num_threads(1)  # tiny shapes: one thread beats contended ones
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; run with --dry-run for the CPU path (tiny sizes)")
    return torch.device("cuda")


def sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable, device, warmup: int = 1, repeats: int = 3) -> list[float]:
    """Wall seconds of `repeats` calls of fn() after `warmup` untimed ones, each synchronised on the device."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def reset_peak(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device) -> int | None:
    """The device's peak allocated bytes since `reset_peak` (None on CPU: no allocator statistics there)."""
    import torch

    return torch.cuda.max_memory_allocated(device) if torch.device(device).type == "cuda" else None


def free_bytes(device) -> int | None:
    import torch

    return torch.cuda.mem_get_info(device)[0] if torch.device(device).type == "cuda" else None


def is_oom(error: BaseException) -> bool:
    """Whether `error` is the device running out of memory (torch raises a RuntimeError subclass)."""
    return "out of memory" in str(error).lower() or type(error).__name__ == "OutOfMemoryError"


def release(device) -> None:
    import gc

    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


# Kernel-name fragments of the SDPA backends, in the order they are tested (cuDNN's names also say "flash").
BACKEND_KERNELS = (("cudnn", ("cudnn",)), ("flash", ("flash",)), ("efficient", ("fmha", "efficient", "mem_eff")),
                   ("flex", ("triton_tem_fused", "flex_attention")))


def classify_kernels(names: list[str]) -> str:
    """Which attention kernel a profiled call ran, from its CUDA kernel names: cudnn, flash, efficient, flex, or
    math (no fused attention kernel: the matmul-softmax-matmul fallback); 'cpu' when no CUDA kernel ran."""
    lowered = [n.lower() for n in names]
    if not lowered:
        return "cpu"
    for backend, fragments in BACKEND_KERNELS:
        if any(f in n for n in lowered for f in fragments):
            return backend
    return "math"


def kernels_of(fn: Callable, device) -> list[str]:
    """The names of the CUDA kernels one call of fn() launches ([] on CPU)."""
    import torch

    if torch.device(device).type != "cuda":
        fn()
        return []
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    return sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


class Budget:
    """A part's time budget in seconds, counted from its creation: `left()`, and `over()` once spent."""

    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.perf_counter()

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)

    def over(self) -> bool:
        return self.left() <= 0


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=1, default=str) + "\n")


def versions(device) -> dict:
    """What the report states the numbers came from: device name, driver / CUDA, torch, transformers."""
    import platform

    import torch
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "cuda": torch.version.cuda, "device": str(device)}
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / GIB, 1),
                   capability=".".join(map(str, torch.cuda.get_device_capability(device))))
    return out

"""Whether bf16 pays on this machine's CPU: many CPUs have no bf16 arithmetic units, and there torch's bf16 matmuls
run several times slower than fp32 (issue 22 reports about 8x on one such machine). Measured once per process, on a
small matmul, so a bf16 run on such a CPU says what it costs before it starts.

A default that picks bf16 must not depend on a timing (a loaded machine would flip it between runs): `bf16_units`
reads what the hardware has instead (a CUDA device's bf16 support; on a CPU the avx512_bf16 / amx_bf16 flags, or
Arm's bf16 feature), the same answer on every run of one machine."""
from __future__ import annotations

import functools
import time

SLOW = 1.5  # bf16 / fp32 time above which bf16 is called slow


def _median_seconds(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


@functools.cache
def cpu_bf16_slowdown(size: int = 384) -> float:
    """How many times longer a bf16 matmul takes than an fp32 one on this CPU (median of 5, after a warm-up)."""
    import torch

    a32 = torch.randn(size, size)
    a16 = a32.to(torch.bfloat16)
    for a in (a32, a16):  # warm-up: thread pools, kernel selection
        a @ a
    return _median_seconds(lambda: a16 @ a16) / max(_median_seconds(lambda: a32 @ a32), 1e-9)


def bf16_cpu_warning(what: str, instead: str) -> str | None:
    """One line for a bf16 run on a CPU where bf16 is slow (None where it is not): `what` names the setting,
    `instead` the faster choice."""
    ratio = cpu_bf16_slowdown()
    if ratio <= SLOW:
        return None
    return (f"{what} on this CPU: a bf16 matmul takes {ratio:.1f}x as long as an fp32 one here (no fast bf16 "
            f"arithmetic); {instead} runs faster on this machine")


def warn_if_slow_bf16(command: str, what: str, instead: str) -> None:
    """Print `bf16_cpu_warning(what, instead)` to stderr as `command: warning: ...` where bf16 is slow here."""
    import sys

    slow = bf16_cpu_warning(what, instead)
    if slow:
        print(f"{command}: warning: {slow}", file=sys.stderr, flush=True)


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return frozenset(word for line in f if line.startswith(("flags", "Features")) for word in line.split())
    except OSError:  # not Linux: no flags to read, so no claim of bf16 units
        return frozenset()


def bf16_units(device: str = "cpu") -> bool:
    """Does `device` have bf16 arithmetic units (a deterministic check, no timing)?"""
    if str(device).startswith("cuda"):
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    return bool(_cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"})


def auto_dtype(dtype: str, device) -> str:
    """A `--dtype`-like option as run: `auto` is bfloat16 where `device` has bf16 units (`bf16_units`: the hardware,
    never a timing, so one machine always resolves it alike), else float32; any other name is returned as given.
    Read by convert-gqa's --transfer-dtype, gqakit sample's --dtype and data-free calibration's sampling."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if bf16_units(str(device)) else "float32"

"""The devices a user names (`gqakit eval --device`, `convert-gqa --calibration-device`): checked to exist on this
machine before any work, one line naming the fix. `cpu` (and `auto`) are answered without loading torch."""
from __future__ import annotations

import re

from gqakit.common.errors import GqakitError, opt

KINDS = ("cpu", "cuda", "mps")  # the device types gqakit runs on


def check_device_name(name: str, option: str) -> str:
    """`name` if it names a device gqakit runs on (cpu, cuda, cuda:N, mps), whether or not this machine has it, as a
    plan made on one machine for another checks it; else one line. No torch import."""
    if re.fullmatch(r"cpu|mps|cuda(:\d+)?", name):
        return name
    raise GqakitError(f"unknown {opt(option, repr(name))}; use cpu, cuda or cuda:N")


def check_device(name: str, option: str, auto: bool = False) -> str:
    """`name` if it is a device of this machine (with `auto`, also "auto": CUDA when available, else CPU), else
    GqakitError: an unknown name, cuda without a CUDA device or past the last one (cuda:7 of 2), mps off Apple
    silicon, a device type gqakit does not run on. `option` names the option for the message (`opt`)."""
    if name == "cpu" or (auto and name == "auto"):
        return name
    import torch

    usable = ("auto, " if auto else "") + "cpu, cuda or cuda:N"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise GqakitError(f"unknown {opt(option, repr(name))}; use {usable}") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise GqakitError(f"{opt(option, name)}: no CUDA device is available here; use {opt(option, 'cpu')}")
        if device.index is not None and device.index >= count:
            raise GqakitError(f"{opt(option, name)}: this machine has {count} CUDA device{'s' * (count > 1)} "
                              f"(cuda:0 to cuda:{count - 1}); use one of them or cpu")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise GqakitError(f"{opt(option, name)}: no Apple MPS device is available here; use {opt(option, 'cpu')}")
    elif device.type != "cpu":
        raise GqakitError(f"{opt(option, name)}: gqakit runs on {', '.join(KINDS)}, not {device.type}; use {usable}")
    return name

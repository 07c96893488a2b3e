"""Where this process stands in a launch, as torchrun and accelerate launch say it in the environment (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE); a process started on its own is rank 0 of a world of one. Read here
only, so that every part agrees on what an unset or empty variable means. No torch."""
from __future__ import annotations

import os


def _read(name: str, default: int) -> int:
    return int(os.environ.get(name) or default)  # unset or empty: the default


def rank() -> int:
    """This process's rank among all (RANK)."""
    return _read("RANK", 0)


def world_size() -> int:
    """How many processes the launch started (WORLD_SIZE)."""
    return _read("WORLD_SIZE", 1)


def local_rank() -> int:
    """This process's rank on its machine (LOCAL_RANK): its GPU's index."""
    return _read("LOCAL_RANK", 0)


def local_world_size() -> int:
    """How many processes share this machine (LOCAL_WORLD_SIZE)."""
    return max(1, _read("LOCAL_WORLD_SIZE", 1))

"""How a run's model state meets the processes: the two sharding strategies of `sharding: ddp | fsdp`.

Each strategy says, in one place, what the loop, the recipe check and the memory plan need to know: how the
student and teacher are loaded, whether they go through `accelerator.prepare`, how gradient sync is held off
between micro-steps, how the global gradient norm is clipped, what runs under autocast, and whether the state
is split over the processes. They are `Replicated` (DDP) and `FullySharded` (FSDP2); a `Strategy` is either.
The FSDP2 machinery itself is in `fsdp.py`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from gqakit.common.errors import GqakitError


@dataclasses.dataclass(frozen=True)
class Replicated:
    """DDP (`sharding: ddp`): every process holds the whole model and its optimizer state, nothing is sharded;
    gradients are averaged (accelerate)."""

    name: str = "ddp"
    shards_state: bool = False  # parameters, gradients and AdamW state split over the processes

    def autocast(self, mixed_precision: str) -> str:
        """accelerate's mixed_precision for this strategy."""
        return mixed_precision

    def activation_dtypes(self, mixed_precision: str) -> tuple[int, int, bool]:
        """(compute bytes, residual-stream bytes, autocast over fp32 weights?) for the memory plan."""
        half = mixed_precision in ("bf16", "fp16")
        return (2 if half else 4), 4, half

    def check(self, mixed_precision: str, checkpoints: dict[str, str | None]) -> None:
        """Refuse what this strategy cannot run, before any work ({role: path} of the models)."""

    def load(self, path: str, device, mixed_precision: str, prepare: Callable, role: str = "model"):
        """A model on `device` with `prepare(model)` applied before it is wrapped."""
        from gqakit.uptrain.modeling import load_lm

        model = load_lm(path)
        prepare(model)
        return model.to(device) if role == "teacher" else model

    def prepare(self, accelerator, model, optimizer):
        return accelerator.prepare(model, optimizer)

    def hold_sync(self, accelerator, model):
        """A context in which backward does not reduce gradients (a micro-step that is not the last)."""
        return accelerator.no_sync(model)

    def clip(self, accelerator, model, trained: list, max_norm: float):
        """Clip the global gradient norm; returns the norm before clipping (every rank)."""
        return accelerator.clip_grad_norm_(model.parameters(), max_norm)


@dataclasses.dataclass(frozen=True)
class FullySharded:
    """FSDP2 (`sharding: fsdp`, `fsdp.py`): parameters, gradients and AdamW state sharded over every process;
    loaded shard by shard, never whole on a rank; mixed precision is FSDP2's policy (bf16 compute, fp32
    reduction and master weights)."""

    name: str = "fsdp"
    shards_state: bool = True

    def autocast(self, mixed_precision: str) -> str:
        return "no"  # FSDP2's policy casts, not autocast

    def activation_dtypes(self, mixed_precision: str) -> tuple[int, int, bool]:
        c = 2 if mixed_precision in ("bf16", "fp16") else 4
        return c, c, False  # FSDP2's policy gathers the parameters in the compute dtype

    def check(self, mixed_precision: str, checkpoints: dict[str, str | None]) -> None:
        if mixed_precision == "fp16":
            raise GqakitError("mixed_precision=fp16 with sharding=fsdp would need a sharded loss scaler; use "
                              "mixed_precision=bf16 (FSDP2's policy: bf16 compute, fp32 reduction and master weights)")
        from gqakit.uptrain.fsdp import check_wrappable

        for role, path in checkpoints.items():
            if path is not None:
                check_wrappable(path, role)

    def load(self, path: str, device, mixed_precision: str, prepare: Callable, role: str = "model"):
        from gqakit.uptrain import fsdp

        mesh, policy = fsdp.make_mesh(device.type), fsdp.mp_policy(mixed_precision)
        return fsdp.load_sharded(path, mesh, policy, device, prepare, role=role)

    def prepare(self, accelerator, model, optimizer):
        return model, optimizer  # already sharded; accelerate's own FSDP would run DDP on CPU

    def hold_sync(self, accelerator, model):
        from gqakit.uptrain.fsdp import gradient_sync

        return gradient_sync(model, False)

    def clip(self, accelerator, model, trained: list, max_norm: float):
        import torch

        from gqakit.uptrain.fsdp import full_tensor

        return full_tensor(torch.nn.utils.clip_grad_norm_(trained, max_norm))  # DTensor grads: a global norm


Strategy = Replicated | FullySharded
STRATEGIES = {s.name: s for s in (Replicated(), FullySharded())}
NAMES = tuple(STRATEGIES)


def strategy(name: str) -> Strategy:
    """The strategy of `sharding: name` (the recipe's choices are NAMES)."""
    return STRATEGIES[name]

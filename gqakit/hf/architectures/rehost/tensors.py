"""Building blocks of the re-host mappings: take stored tensors by name, derive new ones lazily. A mapping is built
without torch (a plan reads no tensor); torch is imported when a derived tensor is made."""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from gqakit.common.errors import GqakitError
from gqakit.hf.headers import DerivedTensor, TensorInfo

if TYPE_CHECKING:  # torch only in annotations: the module imports without it
    import torch


class Source:
    """The source checkpoint's tensors; records which ones a mapping used. Its loaders keep the last few tensors
    they read (`RECENT`), so the several tensors derived from one stored tensor, written one after another (q, k
    and v of a fused projection, each weight and its folded bias), read and upcast it once; callers never change
    a loaded tensor in place."""

    RECENT = 4

    def __init__(self, family: str, tensors: dict[str, TensorInfo]):
        self.family, self.tensors, self.used = family, tensors, set()
        self._recent: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str, shape: tuple[int, ...] | None = None) -> TensorInfo:
        if name not in self.tensors:
            raise GqakitError(f"tensor '{name}' is missing from the {self.family} checkpoint; the weights do not "
                              "match config.json")
        info = self.tensors[name]
        if shape is not None and tuple(info.shape) != tuple(shape):
            raise GqakitError(f"tensor '{name}' has shape {list(info.shape)} but config.json implies {list(shape)}; "
                              "the weights do not match the config")
        self.used.add(name)
        return info

    def loader(self, name: str, shape: tuple[int, ...] | None = None) -> Callable[[], torch.Tensor]:
        """A function that reads the tensor (float32) when called; the name is checked now."""
        info = self.info(name, shape)
        return lambda: self._load(info, name)

    def _load(self, info: TensorInfo, name: str) -> torch.Tensor:
        from gqakit.hf.checkpoint import load_tensor

        with self._lock:
            if name in self._recent:
                self._recent.move_to_end(name)
                return self._recent[name]
            tensor = load_tensor(info, name).float()
            self._recent[name] = tensor
            while len(self._recent) > self.RECENT:
                self._recent.popitem(last=False)
            return tensor


def derived(like: TensorInfo, shape: tuple[int, ...], make: Callable[[], torch.Tensor]) -> DerivedTensor:
    """A tensor of `like`'s dtype and the given shape, computed by make() (in float32, cast here)."""
    def cast() -> torch.Tensor:
        from gqakit.hf.checkpoint import DTYPES

        return make().to(DTYPES[like.dtype]).contiguous()
    return DerivedTensor(file=like.file, dtype=like.dtype, shape=tuple(shape), start=like.start, end=like.end,
                         make=cast)


def constant(like: TensorInfo, shape: tuple[int, ...], value: float) -> DerivedTensor:
    """A tensor of `like`'s dtype filled with value (a norm's unit scale, a bias the source does not have)."""
    def fill() -> torch.Tensor:
        import torch

        return torch.full(shape, float(value))
    return derived(like, shape, fill)


def fold_norm(weight: Callable, bias: Callable | None, gamma: Callable, beta: Callable):
    """Linear(gamma * n + beta) = Linear'(n): W' = W diag(gamma), b' = b + W beta. Returns (W', b') makers."""
    def w() -> torch.Tensor:
        return weight() * gamma()[None, :]

    def b() -> torch.Tensor:
        folded = weight() @ beta()
        return folded + bias() if bias is not None else folded
    return w, b


def base_prefix(family: str, tensors: dict[str, TensorInfo], probe: str, prefixes: tuple[str, ...]) -> str:
    """The prefix this checkpoint stores its base model under: a checkpoint saved from the base class (GPT-2's
    hub weights: `wte.weight`) has none, one saved from the LM class has it (`transformer.wte.weight`)."""
    for prefix in prefixes:
        if prefix + probe in tensors:
            return prefix
    raise GqakitError(f"the {family} checkpoint has no '{prefixes[0]}{probe}'; the weights do not match config.json")

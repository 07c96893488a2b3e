"""Calibration for activation-aware merges: one streaming pass, layer by layer, from the safetensors shards.

The model is built on the meta device. Only the parts outside the decoder layers (embedding, final norm,
RoPE tables) and ONE decoder layer at a time hold real weights, read tensor by tensor from the shards, so
a model larger than RAM calibrates in the memory of one layer plus the calibration activations
(windows x tokens x hidden_size) and one layer's statistics. The hidden states of every window move
through layer i before layer i + 1 is read ("layer-major"), each layer once.

What the model's forward does around its layers (embedding scale, masks, RoPE tables, per-layer
attention types) is not re-implemented: the model's own forward runs once per window with every decoder
layer replaced by a recorder that keeps the layer's inputs, and each real layer is later called with
exactly those inputs.

Statistics of layer i (float64 sums, stored as float32 per layer on disk by the caller), over the
attention input x (the tensor `q_proj` reads) of the fitting windows:

* `input` E[x x^T] and `mean` E[x];
* `key`  E over query heads and query positions m of Cov_{s ~ a_m}(x_s): the covariance of the inputs a
  query attends to, weighted by its attention probabilities a_m. A first-order change of the logits
  changes the softmax only through this covariance, so it is the metric in which key errors matter;
* `value` E over heads and queries of xbar_m xbar_m^T with xbar_m = sum_s a_ms x_s (the attention-averaged
  input that value heads turn into what reaches o_proj), and `value_mean` E[xbar_m].

Held-out windows are kept whole (their attention inputs, RoPE tables and mask) so that a merge can be
scored on the attention logits it changes.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
from torch import nn

from ..errors import GqakitError
from .architectures import ArchSpec
from .checkpoint import TensorInfo, load_tensor

F64 = torch.float64
STATS = ("input", "mean", "key", "value", "value_mean")


@dataclasses.dataclass
class MomentSums:
    """Running float64 sums of one layer's statistics (`STATS`), with their counts."""

    input: torch.Tensor
    mean: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    value_mean: torch.Tensor
    tokens: int = 0
    queries: int = 0  # head x query pairs

    @classmethod
    def zeros(cls, n: int, device="cpu") -> "MomentSums":
        return cls(*(torch.zeros(*s, dtype=F64, device=device) for s in ((n, n), (n,), (n, n), (n, n), (n,))))

    def add(self, x: torch.Tensor, probs: torch.Tensor) -> None:
        """One window: x (T, n) attention input, probs (H, T, T) attention probabilities (rows sum to 1)."""
        x = x.to(torch.float32)
        a = probs.to(torch.float32)
        xbar = (a @ x).reshape(-1, x.shape[1])  # (H*T, n): every query's attended input
        value = (xbar.T @ xbar).to(F64)
        weight = a.sum(dim=(0, 1))  # (T,): how much attention each key position receives in all
        self.input += (x.T @ x).to(F64)
        self.mean += x.sum(0).to(F64)
        self.key += ((x * weight[:, None]).T @ x).to(F64) - value  # sum_m [E_a(x x^T) - xbar xbar^T]
        self.value += value
        self.value_mean += xbar.sum(0).to(F64)
        self.tokens += x.shape[0]
        self.queries += xbar.shape[0]

    def moments(self) -> dict[str, torch.Tensor]:
        """The expectations (sums over counts), float64, divided in place (no second copy of the sums):
        call once, at the end."""
        t, q = max(self.tokens, 1), max(self.queries, 1)
        return {"input": self.input.div_(t), "mean": self.mean.div_(t), "key": self.key.div_(q),
                "value": self.value.div_(q), "value_mean": self.value_mean.div_(q)}


def reference_moments(x: torch.Tensor, probs: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same statistics from an explicit loop over heads and queries (slow; for tests). x (N, T, n),
    probs (N, H, T, T)."""
    x, probs = x.to(F64), probs.to(F64)
    n = x.shape[-1]
    acc = {k: torch.zeros(n, n, dtype=F64) for k in ("input", "key", "value")}
    acc.update(mean=torch.zeros(n, dtype=F64), value_mean=torch.zeros(n, dtype=F64))
    tokens = queries = 0
    for w in range(x.shape[0]):
        for t in range(x.shape[1]):
            acc["input"] += torch.outer(x[w, t], x[w, t])
            acc["mean"] += x[w, t]
            tokens += 1
        for h in range(probs.shape[1]):
            for m in range(x.shape[1]):
                a = probs[w, h, m]
                xbar = a @ x[w]
                second = sum(a[s] * torch.outer(x[w, s], x[w, s]) for s in range(x.shape[1]))
                acc["key"] += second - torch.outer(xbar, xbar)
                acc["value"] += torch.outer(xbar, xbar)
                acc["value_mean"] += xbar
                queries += 1
    return {k: v / (tokens if k in ("input", "mean") else queries) for k, v in acc.items()}


def make_windows(ids: torch.Tensor, window: int, tokens: int) -> torch.Tensor:
    """Disjoint windows (N, window) from the first `tokens` ids (a partial last window is dropped)."""
    count = min(tokens, ids.numel()) // window
    return ids[: count * window].reshape(count, window)


def heldout_count(windows: int) -> int:
    """Windows kept out of the statistics to score a merge: one in eight, at least one."""
    return max(1, windows // 8)


class _Recorder(nn.Module):
    """Stands in for a decoder layer: keeps the inputs the model's forward passes to it, returns its input."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        for name in ("attention_type", "layer_idx", "is_sliding"):  # read by some models' forward loops
            if hasattr(layer, name):
                setattr(self, name, getattr(layer, name))
        self.args: tuple = ()
        self.kwargs: dict = {}

    def forward(self, hidden_states, *args, **kwargs):
        self.args, self.kwargs = (hidden_states, *args), kwargs
        return hidden_states


def _set_param(root: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = root.get_submodule(owner) if owner else root
    module._parameters[leaf] = nn.Parameter(value, requires_grad=False)


def _materialise(module: nn.Module, prefix: str, tensors: dict[str, TensorInfo], device, what: str,
                 recurse: bool = True) -> None:
    """Give `module`'s parameters real storage on `device` (float32), read from the checkpoint by name.
    Buffers were built for real by the constructor (only parameters start on the meta device)."""
    for name, _ in list(module.named_parameters(recurse=recurse)):
        full = prefix + name
        if full not in tensors:
            raise GqakitError(f"calibration needs '{full}' ({what}) but the checkpoint has no such tensor; "
                              "the weights do not match config.json")
        _set_param(module, name, load_tensor(tensors[full], full).to(device=device, dtype=torch.float32))


def _release(module: nn.Module) -> None:
    """Send `module`'s parameters back to the meta device (its memory is freed)."""
    for name, param in list(module.named_parameters()):
        _set_param(module, name, torch.empty_like(param, device="meta"))


class LayerwiseModel:
    """A model on the meta device whose layers are run one at a time on calibration windows."""

    def __init__(self, config: dict, spec: ArchSpec, tensors: dict[str, TensorInfo], device="cpu"):
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "auto_map"})
        with init_empty_weights(include_buffers=False):  # parameters on meta; buffers (RoPE tables, scales) real
            self.model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
        self.model.eval()
        self.device = torch.device(device)
        for name, buf in self.model.named_buffers():
            if buf.is_meta:
                raise GqakitError(f"calibration could not build the buffer '{name}'; use --method aligned without "
                                  "--calibration for this model")
        self.spec = spec
        self.tensors = tensors
        self.prefix = spec.q_proj.split("{i}")[0]  # "model.layers."
        self.layers: nn.ModuleList = self.model.get_submodule(self.prefix.rstrip("."))
        self.real = list(self.layers)
        self.recorders = [_Recorder(layer) for layer in self.real]
        for i, rec in enumerate(self.recorders):
            self.layers[i] = rec
        base_name = self.prefix.split(".")[0]  # "model": the part of the CausalLM that runs the layers
        self.base = self.model.get_submodule(base_name)
        # everything of the base outside the decoder layers (embedding, final norm): real from here on
        _materialise(self.base, base_name + ".", tensors, self.device, "the embedding and final norm")
        self.base.to(self.device)

    @torch.no_grad()
    def layer_inputs(self, window: torch.Tensor) -> tuple[torch.Tensor, list[dict]]:
        """Run the model's forward around the recorders on one window: (layer 0's hidden input (1, T, n),
        every layer's keyword inputs: mask, RoPE tables, positions)."""
        self.base(input_ids=window[None].to(self.device), use_cache=False)
        rec = self.recorders[0]
        return rec.args[0], [dict(r.kwargs) for r in self.recorders]

    def load_layer(self, i: int) -> nn.Module:
        layer = self.real[i]
        _materialise(layer, f"{self.prefix}{i}.", self.tensors, self.device, f"layer {i}")
        return layer.to(self.device)

    def free_layer(self, i: int) -> None:
        _release(self.real[i])


def _attention_module(layer: nn.Module, spec: ArchSpec, prefix: str, i: int) -> tuple[nn.Module, nn.Module]:
    q_name = spec.q_proj.format(i=i)[len(f"{prefix}{i}."):]  # "self_attn.q_proj"
    q_proj = layer.get_submodule(q_name)
    return layer.get_submodule(q_name.rpartition(".")[0]), q_proj


def calibrate(config: dict, spec: ArchSpec, tensors: dict[str, TensorInfo], windows: torch.Tensor, heldout: int,
              device="cpu", progress: bool = True):
    """Yield (layer index, moments dict, held-out dict) layer by layer.

    `windows` (N, T) token ids; the last `heldout` windows are held out of the statistics and returned
    whole: {"x": (N_h, T, n) attention inputs, "cos"/"sin": (T, head_dim) RoPE tables, "allowed": (T, T)
    which keys each query may attend to}. Only one layer's weights, statistics and attention
    probabilities are held at a time.
    """
    from tqdm.auto import tqdm

    lm = LayerwiseModel(config, spec, tensors, device)
    hidden, layer_kwargs = [], None
    for w in windows:
        h, kw = lm.layer_inputs(w)
        hidden.append(h)
        layer_kwargs = layer_kwargs or kw
    hidden = torch.cat(hidden)  # (N, T, n)
    _release(lm.base)  # the embedding and final norm are done with: only one decoder layer is held from here
    fit = windows.shape[0] - heldout
    n = hidden.shape[-1]
    bar = tqdm(range(len(lm.real)), desc="calibrate", unit="layer", disable=not progress)
    for i in bar:
        layer = lm.load_layer(i)
        attn, q_proj = _attention_module(layer, spec, lm.prefix, i)
        seen: dict[str, torch.Tensor] = {}
        hooks = [q_proj.register_forward_pre_hook(lambda _m, args: seen.__setitem__("x", args[0].detach())),
                 attn.register_forward_hook(lambda _m, _a, out: seen.__setitem__("probs", out[1]))]
        sums = MomentSums.zeros(n, lm.device)
        held_x = []
        kwargs = layer_kwargs[i]
        mask = kwargs.get("attention_mask")
        if not isinstance(mask, torch.Tensor) or mask.shape[-2:] != hidden.shape[1:2] * 2:
            raise GqakitError(f"layer {i} received no (T, T) attention mask from the model's forward, so calibration "
                              "cannot tell which keys each query sees; use --method aligned without --calibration")
        try:
            with torch.no_grad():
                for w in range(hidden.shape[0]):
                    seen.clear()
                    hidden[w : w + 1] = layer(hidden[w : w + 1], **kwargs)
                    if seen.get("probs") is None:
                        raise GqakitError(f"layer {i}'s attention returned no probabilities; calibration needs "
                                          "eager attention weights")
                    if w < fit:
                        sums.add(seen["x"][0], seen["probs"][0])
                    else:
                        held_x.append(seen["x"][0].to("cpu", torch.float32))
        finally:
            for hk in hooks:
                hk.remove()
        if not torch.isfinite(hidden).all():
            raise GqakitError(f"calibration activations became non-finite after layer {i}; the checkpoint may be "
                              "broken (try evaluating it with gqakit eval ppl)")
        cos, sin = kwargs["position_embeddings"]
        T = hidden.shape[1]
        allowed = (kwargs["attention_mask"].reshape(-1, T, T)[0] == 0).cpu()
        held = {"x": torch.stack(held_x), "cos": cos[0].float().cpu(), "sin": sin[0].float().cpu(), "allowed": allowed}
        moments = {k: v.cpu() for k, v in sums.moments().items()}
        lm.free_layer(i)
        yield i, moments, held
        del moments, held, sums


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half RoPE on (..., T, d) with cos/sin (T, d)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def logit_error(held: dict, before: tuple, after: tuple, num_heads: int, kv_before: int, kv_after: int,
                head_dim: int) -> float:
    """Relative error of every query head's attention logits (before scaling and softcapping) on held-out
    windows: sqrt(sum ||S'_j - S_j||^2 / sum ||S_j||^2) over allowed query/key pairs.

    `before` / `after` are (q_w, k_w, q_b, k_b) of the original (heads in the merge's order) and merged layer.
    """
    num = den = 0.0
    allowed = held["allowed"].to(F64)
    cos, sin = held["cos"].to(F64), held["sin"].to(F64)

    def logits(x, q_w, k_w, q_b, k_b, kv):
        q = x @ q_w.to(F64).T + (0 if q_b is None else q_b.to(F64))
        k = x @ k_w.to(F64).T + (0 if k_b is None else k_b.to(F64))
        q = rope(q.reshape(-1, num_heads, head_dim).transpose(0, 1), cos, sin)  # (H, T, d)
        k = rope(k.reshape(-1, kv, head_dim).transpose(0, 1), cos, sin)  # (kv, T, d)
        k = k.repeat_interleave(num_heads // kv, dim=0)
        return q @ k.transpose(1, 2)  # (H, T, T)

    for x in held["x"]:
        x = x.to(F64)
        s0 = logits(x, *before, kv_before) * allowed
        s1 = logits(x, *after, kv_after) * allowed
        num += float((s1 - s0).pow(2).sum())
        den += float(s0.pow(2).sum())
    return math.sqrt(num / max(den, 1e-300))


def save_layer(folder: Path, layer: int, moments: dict, held: dict) -> Path:
    """One layer's statistics as float32 safetensors (the merge reads them back one layer at a time)."""
    from safetensors.torch import save_file

    path = folder / f"layer-{layer:05d}.safetensors"
    tensors = {k: v.to(torch.float32).contiguous() for k, v in moments.items()}
    tensors.update({f"heldout.{k}": (v.to(torch.uint8) if v.dtype == torch.bool else v.float()).contiguous()
                    for k, v in held.items()})
    save_file(tensors, str(path))
    return path


def load_layer(folder: Path, layer: int, keys: tuple[str, ...] = STATS) -> tuple[dict, dict]:
    """One layer's statistics `keys` (float64) and its held-out windows, read back from `save_layer`'s file."""
    from safetensors import safe_open

    with safe_open(str(folder / f"layer-{layer:05d}.safetensors"), framework="pt") as f:
        moments = {k: f.get_tensor(k).to(F64) for k in keys}
        held = {k[len("heldout."):]: f.get_tensor(k) for k in f.keys() if k.startswith("heldout.")}
    held["allowed"] = held["allowed"].bool()
    return moments, held

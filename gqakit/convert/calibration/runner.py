"""Calibration for activation-aware merges: one streaming pass, layer by layer, from the safetensors shards.

The model is built on the meta device and no weight matrix is ever held whole in fp32. In the decoder layer
being calibrated every `nn.Linear` is replaced by a `StreamedLinear`, which reads its weight from the shards
in row blocks of at most `BLOCK_BYTES` of fp32 during the forward (one block in memory at a time); a plain
`nn.Embedding` is replaced by a `StreamedEmbedding`, which reads only the rows of the window's tokens. The
small parameters (norms, biases, and the embedding of families that subclass `nn.Embedding`) are read whole.
The hidden states of all windows wait in a float32 scratch file, one window per record, and every window
moves through layer i before layer i + 1 is read ("layer-major"). The fitting windows' attention inputs and
attention terms (below) wait in scratch files too, and each of the layer's three n x n statistics is then summed
alone over them and written to the layer's file. So calibration holds one window's activations and one weight
block while a layer runs, then one n x n float64 sum, whatever the size of the model or of the calibration data.

What the model's forward does around its layers (embedding scale, masks, RoPE tables, per-layer
attention types) is not re-implemented: the model's own forward runs once per window with every decoder
layer replaced by a recorder that keeps the layer's inputs, and each real layer (its own forward, with
streamed linears) is later called with exactly those inputs.

The statistics summed per layer are `moments.STATS`; each layer's go to one file (`stored.LayerFile`). Held-out
windows are kept whole (their attention inputs, RoPE tables and mask) so that a merge can be scored on the
attention logits it changes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from gqakit.common.errors import GqakitError, opt
from gqakit.hf.architectures import ArchSpec
from gqakit.hf.checkpoint import load_tensor
from gqakit.hf.headers import TensorInfo
from gqakit.hf.fields import config_object
from gqakit.convert.calibration.moments import STATS, SUMS, attention_terms, sum_moments
from gqakit.convert.calibration.stored import LayerFile, layer_path
from gqakit.convert.calibration.streamed import WindowStates, missing_tensor, stream_weights

MLP_TOKENS = 128  # positions per chunk of a calibration layer's MLP


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
            raise missing_tensor(full, what)
        _set_param(module, name, load_tensor(tensors[full], full).to(device=device, dtype=torch.float32))


def _release(module: nn.Module) -> None:
    """Send `module`'s parameters back to the meta device (its memory is freed)."""
    for name, param in list(module.named_parameters()):
        _set_param(module, name, torch.empty_like(param, device="meta"))


class _TokenChunks(nn.Module):
    """Runs a position-wise module (a decoder layer's MLP) over `tokens` positions at a time: the same values,
    with its intermediates (tokens x intermediate_size, several of them) for a chunk instead of the window."""

    def __init__(self, inner: nn.Module, tokens: int | None = None):
        super().__init__()
        self.inner, self.tokens = inner, tokens or MLP_TOKENS

    def forward(self, x: torch.Tensor, *args, **kwargs):  # (B, T, n) -> (B, T, n)
        if x.dim() != 3 or x.shape[1] <= self.tokens:
            return self.inner(x, *args, **kwargs)
        first = self.inner(x[:, : self.tokens], *args, **kwargs)
        if not isinstance(first, torch.Tensor):  # e.g. a mixture of experts' (output, router logits): whole
            return self.inner(x, *args, **kwargs)
        rest = [self.inner(x[:, t : t + self.tokens], *args, **kwargs)
                for t in range(self.tokens, x.shape[1], self.tokens)]
        return torch.cat([first, *rest], dim=1)


class LayerwiseModel:
    """A model on the meta device whose layers are run one at a time on calibration windows."""

    def __init__(self, config: dict, spec: ArchSpec, tensors: dict[str, TensorInfo], device="cpu"):
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        cfg = config_object(config)
        with init_empty_weights(include_buffers=False):  # parameters on meta; buffers (RoPE tables, scales) real
            self.model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
        self.model.eval()
        self.device = torch.device(device)
        for name, buf in self.model.named_buffers():
            if buf.is_meta:
                raise GqakitError(f"calibration could not build the buffer '{name}'; use "
                                  f"{opt('method', 'aligned')} without {opt('calibration')} for this model")
        self.spec = spec
        self.tensors = tensors
        self.prefix = spec.q_proj.split("{i}")[0]  # "model.layers."
        self.layers: nn.ModuleList = self.model.get_submodule(self.prefix.rstrip("."))
        self.real = list(self.layers)
        self.recorders = [_Recorder(layer) for layer in self.real]
        for i, rec in enumerate(self.recorders):
            self.layers[i] = rec
        self.swapped: dict[int, list[tuple]] = {}
        base_name = self.prefix.split(".")[0]  # "model": the part of the CausalLM that runs the layers
        self.base = self.model.get_submodule(base_name)
        # everything of the base outside the decoder layers (embedding, final norm): real (or streamed) from here on
        what = "the embedding and final norm"
        stream_weights(self.base, base_name + ".", tensors, what)
        _materialise(self.base, base_name + ".", tensors, self.device, what)
        self.base.to(self.device)

    @torch.no_grad()
    def layer_inputs(self, window: torch.Tensor) -> tuple[torch.Tensor, list[dict]]:
        """Run the model's forward around the recorders on one window: (layer 0's hidden input (1, T, n),
        every layer's keyword inputs: mask, RoPE tables, positions)."""
        self.base(input_ids=window[None].to(self.device), use_cache=False)
        rec = self.recorders[0]
        return rec.args[0], [dict(r.kwargs) for r in self.recorders]

    def load_layer(self, i: int, stream: bool = True) -> nn.Module:
        """Layer i with real small parameters; its linears streamed (or, with stream=False, read whole) and its
        position-wise MLP run over chunks of tokens."""
        layer = self.real[i]
        if stream:
            self.swapped[i] = stream_weights(layer, f"{self.prefix}{i}.", self.tensors, f"layer {i}")
        # before the MLP is wrapped, so that parameter names (e.g. mlp.gate_proj.bias) are the checkpoint's
        _materialise(layer, f"{self.prefix}{i}.", self.tensors, self.device, f"layer {i}")
        if stream and isinstance(getattr(layer, "mlp", None), nn.Module):
            self.swapped[i].append((layer, "mlp", layer.mlp))
            layer.mlp = _TokenChunks(layer.mlp)
        return layer.to(self.device)

    def free_layer(self, i: int) -> None:
        for owner, leaf, module in reversed(self.swapped.pop(i, [])):
            setattr(owner, leaf, module)  # the original linears, still on meta
        _release(self.real[i])


def _attention_module(layer: nn.Module, spec: ArchSpec, prefix: str, i: int) -> tuple[nn.Module, nn.Module]:
    q_name = spec.q_proj.format(i=i)[len(f"{prefix}{i}."):]  # "self_attn.q_proj"
    q_proj = layer.get_submodule(q_name)
    return layer.get_submodule(q_name.rpartition(".")[0]), q_proj


@dataclasses.dataclass
class LayerInputs:
    """What `calibrate(..., with_inputs=True)` yields for a layer whose statistics are complete: the model's own
    attention class, the keyword inputs the model's forward gave that attention (for one window: RoPE tables,
    mask, ...), and the fitting windows' attention inputs, readable until the next layer starts.

    With `converted_inputs`, the inputs are those of the model converted so far, and `read_target` /
    `held_targets` give the original model's attention outputs on its own inputs (what the converted attention
    should reproduce); the consumer then sets `trained_attention` (the layer's converted attention module) before
    asking for the next layer, which runs on what that module makes of the inputs."""

    index: int
    attention_class: type
    attention_kwargs: dict
    windows: int
    read: Callable[[int], torch.Tensor]  # fitting window w's attention input (T, n)
    read_target: Callable[[int], torch.Tensor] | None = None  # fitting window w's original attention output (T, n)
    held_targets: torch.Tensor | None = None  # (N_h, T, n): the held-out windows' original attention outputs
    trained_attention: nn.Module | None = None  # set by the consumer, with converted_inputs


def calibrate(config: dict, spec: ArchSpec, tensors: dict[str, TensorInfo], windows: torch.Tensor, heldout: int,
              folder: Path, device="cpu", progress: bool = True, with_inputs: bool = False,
              converted_inputs: bool = False) -> Iterator[int | LayerInputs]:
    """Calibrate layer by layer into `folder`: yields each layer's index once `layer_path(folder, i)` is complete
    (its `STATS` as float32, the precision they are stored in, summed in float64; read them with
    `stored.load_layer` or `stored.StoredMoment`).

    `windows` (N, T) token ids; the last `heldout` windows are held out of the statistics and stored whole:
    heldout.x (N_h, T, n) attention inputs, heldout.cos / heldout.sin (T, head_dim) RoPE tables and
    heldout.allowed (T, T), which keys each query may attend to. Memory: one weight block and one window's
    activations while the layer runs; then one n x n float64 sum at a time (`sum_moments`), each written to the
    layer's file block by block. The hidden states of all windows, and the fitting windows' attention inputs
    and attention terms, wait in scratch files in `folder`, deleted at the end, also on an error or when the
    caller stops early; the layer files are the caller's. With `with_inputs`, a `LayerInputs` is yielded instead
    of the index (what attention transfer trains on).

    With `converted_inputs` (and `with_inputs`), two streams of hidden states run side by side: the original
    model's, which gives each layer's target attention outputs, and the converted model's, whose attention inputs
    are what the statistics and the yielded inputs describe; each layer of the converted stream runs with the
    `trained_attention` its consumer set (every layer before it already converted).
    """
    if converted_inputs and not with_inputs:
        raise ValueError("converted_inputs needs with_inputs: the consumer supplies each converted attention")
    folder = Path(folder)
    prefixes = {"hidden": "hidden-states-", "inputs": "attention-inputs-", "terms": "attention-terms-"}
    if converted_inputs:
        prefixes.update(teacher="original-states-", targets="attention-targets-")
    with contextlib.ExitStack() as stack:
        files = {}
        for name, prefix in prefixes.items():
            fd, path = tempfile.mkstemp(prefix=prefix, suffix=".f32", dir=folder)
            stack.callback(os.unlink, path)
            files[name] = (stack.enter_context(os.fdopen(fd, "r+b", buffering=0)), path)
        yield from _layer_major(LayerwiseModel(config, spec, tensors, device), windows, heldout, progress, folder,
                                files, with_inputs=with_inputs, converted_inputs=converted_inputs)


def _check_finite(out: torch.Tensor, i: int) -> None:
    if not torch.isfinite(out).all():
        raise GqakitError(f"calibration activations became non-finite after layer {i}; the checkpoint "
                          "may be broken (try evaluating it with gqakit eval ppl)")


def _advance(layer: nn.Module, kwargs: dict, i: int, count: int, states: WindowStates, device,
             before: Callable[[int], None] = lambda w: None) -> None:
    """Every window through layer i: its output replaces its input in `states` (`before(w)` first)."""
    with torch.no_grad():
        for w in range(count):
            before(w)
            out = layer(states.read(w, device), **kwargs)
            _check_finite(out, i)
            states.write(w, out)


def _run_original(layer: nn.Module, attn: nn.Module, kwargs: dict, i: int, count: int, fit: int,
                  states: WindowStates, targets: WindowStates, device) -> torch.Tensor:
    """The original model's stream through layer i: every window's attention output goes to `targets` (fitting
    windows) or the returned (N_h, T, n) held-out targets, and the layer's output replaces its input in `states`."""
    held, w_now = [], [0]

    def record(_module, _args, out):
        y = out[0][0].detach()
        if w_now[0] < fit:
            targets.write(w_now[0], y)
        else:
            held.append(y.to("cpu", torch.float32))

    hook = attn.register_forward_hook(record)
    try:
        _advance(layer, kwargs, i, count, states, device, before=lambda w: w_now.__setitem__(0, w))
    finally:
        hook.remove()
    return torch.stack(held)


def _layer_major(lm: LayerwiseModel, windows: torch.Tensor, heldout: int, progress: bool, folder: Path,
                 files: dict[str, tuple], with_inputs: bool = False, converted_inputs: bool = False):
    from tqdm.auto import tqdm

    states, teacher, layer_kwargs = None, None, None
    for w, ids in enumerate(windows):
        h, kw = lm.layer_inputs(ids)  # (1, T, n)
        if states is None:
            states = WindowStates(*files["hidden"], tuple(h.shape[1:]))
            teacher = WindowStates(*files["teacher"], tuple(h.shape[1:])) if converted_inputs else None
        states.write(w, h)
        if teacher is not None:
            teacher.write(w, h)
        layer_kwargs = layer_kwargs or kw
        del h
    _release(lm.base)  # the final norm (and any embedding read whole) are done with
    count = windows.shape[0]
    fit = count - heldout
    T, n = states.shape
    inputs = WindowStates(*files["inputs"], (T, n))  # the fitting windows' attention inputs
    terms = WindowStates(*files["terms"], (T + 1, T))  # ... and their attention_terms
    targets = WindowStates(*files["targets"], (T, n)) if converted_inputs else None
    bar = tqdm(range(len(lm.real)), desc="calibrate", unit="layer", disable=not progress)
    for i in bar:
        layer = lm.load_layer(i)
        attn, q_proj = _attention_module(layer, lm.spec, lm.prefix, i)
        kwargs = layer_kwargs[i]
        mask = kwargs.get("attention_mask")
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape[-2:]) != (T, T):
            raise GqakitError(f"layer {i} received no (T, T) attention mask from the model's forward, so calibration "
                              f"cannot tell which keys each query sees; use {opt('method', 'aligned')} without "
                              f"{opt('calibration')}")
        held_targets = None
        if converted_inputs:  # first the original stream: its attention outputs are the targets
            held_targets = _run_original(layer, attn, kwargs, i, count, fit, teacher, targets, lm.device)
        seen: dict = {}
        held_x = []

        def attended(_module, _args, out):
            """The window's attention input and attention terms go to scratch as soon as its probabilities
            exist: they are dropped before the MLP runs (the layer discards the probabilities it returns)."""
            if out[1] is None:
                return
            seen["heads"] = out[1].shape[1]
            x = seen.pop("x")[0]  # (T, n)
            if seen["w"] < fit:
                inputs.write(seen["w"], x)
                terms.write(seen["w"], attention_terms(out[1][0]))
            else:
                held_x.append(x.to("cpu", torch.float32))

        attention_kwargs: dict = {}

        def called(_module, args, kwargs):  # the attention's keyword inputs: the same for every window
            if not attention_kwargs:
                attention_kwargs.update({k: v for k, v in kwargs.items() if k != "hidden_states"})
                if len(args) > 1:
                    raise GqakitError(f"layer {i}'s attention takes {len(args)} positional inputs, which attention "
                                      f"transfer cannot replay; use {opt('method', 'fit')}")

        hooks = [q_proj.register_forward_pre_hook(lambda _m, args: seen.__setitem__("x", args[0].detach())),
                 attn.register_forward_hook(attended)]
        if with_inputs:  # only attention transfer replays the attention's inputs
            hooks.append(attn.register_forward_pre_hook(called, with_kwargs=True))
        heads = None
        try:
            with torch.no_grad():
                for w in range(count):
                    seen.clear()
                    seen["w"] = w
                    out = layer(states.read(w, lm.device), **kwargs)  # (1, T, n)
                    if seen.get("heads") is None:
                        raise GqakitError(f"layer {i}'s attention returned no probabilities; calibration needs "
                                          "eager attention weights")
                    heads = seen["heads"]
                    _check_finite(out, i)
                    if not converted_inputs:  # else the converted attention makes the next layer's inputs
                        states.write(w, out)
                    del out
                    seen.clear()  # this window's activations go before the next window runs
        finally:
            for hk in hooks:
                hk.remove()
        if not converted_inputs:
            lm.free_layer(i)
        cos, sin = kwargs["position_embeddings"]
        held = {"x": torch.stack(held_x), "cos": cos[0].float().cpu(), "sin": sin[0].float().cpu(),
                "allowed": (mask.reshape(-1, T, T)[0] == 0).cpu()}
        held_x.clear()
        shapes = {**{name: (n, n) if name in SUMS else (n,) for name in STATS},
                  **{f"heldout.{k}": tuple(v.shape) for k, v in held.items()}}
        with LayerFile(layer_path(folder, i), shapes) as out_file:
            for k, v in held.items():
                out_file.write(f"heldout.{k}", v)
            del held
            sum_moments(fit, lambda w: (inputs.read(w, lm.device)[0], terms.read(w, lm.device)[0]), heads,
                        out_file.write, lm.device)
        if not with_inputs:
            yield i
            continue
        item = LayerInputs(i, type(attn), attention_kwargs, fit, lambda w: inputs.read(w, lm.device)[0])
        if converted_inputs:
            item.read_target = lambda w: targets.read(w, lm.device)[0]
            item.held_targets = held_targets
        yield item
        if converted_inputs:
            if item.trained_attention is None:
                raise ValueError(f"layer {i}: converted_inputs needs the consumer to set trained_attention")
            _run_converted(layer, attn, item.trained_attention, kwargs, i, count, states, lm.device)
            lm.free_layer(i)


def _run_converted(layer: nn.Module, attn: nn.Module, converted: nn.Module, kwargs: dict, i: int, count: int,
                   states: WindowStates, device) -> None:
    """The converted stream through layer i, its attention replaced by `converted`: each window's output
    replaces its input in `states`."""
    owner_name, _, leaf = next(name for name, m in layer.named_modules() if m is attn).rpartition(".")
    owner = layer.get_submodule(owner_name) if owner_name else layer
    setattr(owner, leaf, converted)
    try:
        _advance(layer, kwargs, i, count, states, device)
    finally:
        setattr(owner, leaf, attn)

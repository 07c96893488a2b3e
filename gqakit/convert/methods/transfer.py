"""Attention transfer (`--method transfer`): train each layer's merged attention to reproduce the original's.

After a calibrated merge of a layer (`methods.layer.merge_layer`; `fit`, or `aligned` with `--transfer-start`), the
merged K/V projections (with `--transfer-params qkvo` also Q and O) are trained so that the layer's attention
output, o_proj included, matches the original attention's on the calibration windows, given the original model's
own layer inputs (teacher forcing: every layer trains on what the unconverted model feeds it, so layers are
independent; `--transfer-inputs converted` feeds it the converted model's instead). This is the first,
layer-local stage of LoLCATs' attention transfer (arXiv 2410.10254) applied to K/V-head merging.

Exactness of what is trained: both the original (teacher) and the merged (student) attention are instances of the
model's own attention class, built from the model's config (the student's with the new number of K/V heads), and
called with exactly the keyword inputs the model's forward gave that layer during calibration (RoPE tables, the
attention mask with its sliding window, ...). So RoPE, key norms, biases, softcapping and windows are those of the
model's own code. Attention runs through transformers' sdpa function, or eager where the family softcaps its
logits (sdpa has no softcap); tests check both against eager.

Loss: ||student(x) - teacher(x)||^2 / ||teacher(x)||^2 per batch of windows (about `step_tokens` tokens: two
windows of 512, one of 1,024), its forward and backward in float32 or, with `dtype` bfloat16, under bfloat16
autocast (the weights, the loss and every held-out score stay float32). AdamW, each trained tensor's learning
rate `lr` times its RMS at the start, with linear warm-up and cosine decay; the held-out calibration windows score
the layer before training and every `eval_every` steps, training stops after `patience` scores without improvement
(never, for 0), and the best-scoring weights are kept; a layer whose training never beat its start keeps the
start, so transfer is never worse than its start merge on held-out windows.

Memory: one layer's attention twice (teacher and student, fp32) with AdamW state for the trained projections (each
stepped as backward gives its gradient, so only one gradient is held at a time: `StepInBackward`), the held-out
windows, and one batch of windows; the fitting windows' inputs and the teacher's outputs wait in scratch files
(calibration's), read one batch at a time, and the best-scoring weights in one of their own (`BestWeights`). While
a layer trains, glibc keeps freed blocks for reuse (`convert.memory.heap_kept`) even where the console script
returns freed memory eagerly: every step allocates the same activations, which would otherwise be mapped and
faulted in anew at every step (1.5x the step's time).
"""
from __future__ import annotations

import contextlib
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from gqakit.common.errors import GqakitError, opt
from gqakit.common.precision import auto_dtype
from gqakit.convert.memory import heap_kept
from gqakit.convert.options import PARAMS, TransferOptions
from gqakit.convert.calibration.streamed import WindowStates, write_from
from gqakit.hf.checkpoint import read_into
from gqakit.hf.fields import config_object

def attention_implementation(config: dict) -> str:
    """sdpa, unless the family softcaps attention logits (transformers' sdpa path has no softcap): eager then."""
    return "eager" if config.get("attn_logit_softcapping") not in (None, 0) else "sdpa"


def build_attention(cls: type, config: dict, layer: int, weights: dict[str, torch.Tensor],
                    implementation: str, device="cpu") -> nn.Module:
    """The model's own attention class for layer `layer` of `config` (its K/V heads as the config says), with
    every parameter taken from `weights` (names relative to the attention module) in float32."""
    from accelerate import init_empty_weights

    cfg = config_object(config)
    cfg._attn_implementation = implementation
    with init_empty_weights(include_buffers=False):
        module = cls(cfg, layer_idx=layer)
    for name, param in list(module.named_parameters()):
        if name not in weights:
            raise GqakitError(f"layer {layer}: the attention parameter '{name}' is not in the checkpoint; "
                              f"{opt('method', 'transfer')} cannot rebuild this attention, use {opt('method', 'fit')}")
        value = weights[name].to(device=device, dtype=torch.float32)
        if tuple(value.shape) != tuple(param.shape):
            raise GqakitError(f"layer {layer}: '{name}' has shape {tuple(value.shape)}, the attention expects "
                              f"{tuple(param.shape)}; use {opt('method', 'fit')}")
        owner, _, leaf = name.rpartition(".")
        (module.get_submodule(owner) if owner else module)._parameters[leaf] = nn.Parameter(value.clone())
    for name, buf in module.named_buffers():
        if buf.is_meta:
            raise GqakitError(f"layer {layer}: the attention's buffer '{name}' could not be built; use "
                              f"{opt('method', 'fit')}")
    return module.to(device).eval()  # eval: attention dropout off, as at inference


def attend(module: nn.Module, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """The attention module's output (B, T, n) for inputs x (B, T, n): the layer's recorded keyword inputs
    (shaped for one window) broadcast over the batch."""
    return module(x, **kwargs)[0]


def output_error(module: nn.Module, xs: torch.Tensor, targets: torch.Tensor, kwargs: dict) -> float:
    """sqrt(sum ||module(x) - y||^2 / sum ||y||^2) over windows xs (N, T, n), targets (N, T, n), one at a time."""
    num = den = 0.0
    with torch.no_grad():
        for x, y in zip(xs, targets):
            out = attend(module, x[None], kwargs)[0]
            num += float((out - y).double().pow(2).sum())
            den += float(y.double().pow(2).sum())
    return math.sqrt(num / max(den, 1e-300))


def _lr_factor(step: int, steps: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


class StepInBackward:
    """AdamW stepping each trained tensor the moment backward has its gradient, then dropping that gradient: the
    same updates as one AdamW over per-tensor groups after backward (one optimizer per tensor; AdamW is elementwise),
    but the layer's gradients never all exist at once, only the one being applied. With the trained tensors of a
    latent at half the cache at the Llama-2-7B shape (286 MiB in float32), three steps peak 178 MiB lower (1,534
    against 1,707 MiB of RSS). `groups`: one {"params": [p], "lr": ...} per tensor; `factor` scales every learning
    rate by the step (`advance()` after each backward)."""

    def __init__(self, groups: list[dict], factor: Callable[[int], float], **adamw):
        self.optimizers = [torch.optim.AdamW([group], **adamw) for group in groups]
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in self.optimizers]
        self.hooks = [group["params"][0].register_post_accumulate_grad_hook(self._stepper(o))
                      for group, o in zip(groups, self.optimizers)]

    @staticmethod
    def _stepper(optimizer: torch.optim.Optimizer) -> Callable[[torch.Tensor], None]:
        def step(param: torch.Tensor) -> None:
            optimizer.step()
            param.grad = None
        return step

    def advance(self) -> None:
        """After a backward (whose hooks stepped every tensor): the learning rates move to the next step."""
        for scheduler in self.schedulers:
            scheduler.step()

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


class BestWeights:
    """The best-scoring values of the trained tensors, kept to restore after training: copies in memory, or with
    `scratch` (a folder) in a scratch file written at each `save` and read back into the tensors by `restore`, so
    that the copy adds nothing to the layer's peak (286 MiB of float32 for a latent at half the cache at the
    Llama-2-7B shape; the file is in the page cache, not this process's resident memory). The file is removed by
    `close`."""

    def __init__(self, params: list[torch.Tensor], scratch: Path | None = None):
        self.params, self.path, self.file = params, None, None
        if scratch is None:
            self.copies = [p.detach().clone() for p in params]
            return
        fd, self.path = tempfile.mkstemp(prefix="transfer-best-", suffix=".bin", dir=scratch)
        self.file = os.fdopen(fd, "r+b", buffering=0)
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel() * p.element_size())
        self.save()

    def save(self) -> None:
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if self.file is None:
                    self.copies[i].copy_(p)
                else:
                    write_from(self.file, p, self.offsets[i])

    def restore(self) -> None:
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if self.file is None:
                    p.copy_(self.copies[i])
                else:
                    read_into(self.file, p.detach(), self.offsets[i],
                              f"the transfer scratch file {self.path} ended early; was it changed or its disk full?")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            os.unlink(self.path)
            self.file = None


def transfer_layer(student: nn.Module, kwargs: dict, windows: int,
                   read: Callable[[int], tuple[torch.Tensor, torch.Tensor]], held_x: torch.Tensor,
                   held_y: torch.Tensor, opts: TransferOptions, layer: int, progress: bool = True,
                   select: Callable[[str], bool] | None = None, scratch: Path | None = None) -> dict[str, float]:
    """Train `student`'s projections `opts.params` (or the parameters whose names `select` picks) in place so that
    its output matches the teacher's on the fitting windows; `read(w)` gives window w's input (T, n) and the
    teacher's output on it (T, n). Returns the held-out relative error before and after, and the steps taken."""
    from tqdm.auto import tqdm

    if select is None:
        select = lambda name: name.split(".")[0] in PARAMS[opts.params]  # noqa: E731
    trained = [p for name, p in student.named_parameters() if select(name)]
    if not trained:
        raise GqakitError(f"layer {layer}: the attention has none of {', '.join(PARAMS[opts.params])}; "
                          f"{opt('method', 'transfer')} cannot train it, use {opt('method', 'fit')}")
    for p in student.parameters():
        p.requires_grad_(False)
    for p in trained:
        p.requires_grad_(True)
    # Adam's steps are about lr per element whatever the weights' scale: make them the same fraction of every
    # tensor's RMS (SmolLM2's attention weights have RMS ~0.2, the embedded model's ~0.03)
    groups = [{"params": [p], "lr": opts.lr * max(float(p.detach().pow(2).mean().sqrt()), 1e-8)} for p in trained]
    warmup = max(1, int(opts.steps * opts.warmup))
    optimizer = StepInBackward(groups, lambda s: _lr_factor(s, opts.steps, warmup), betas=(0.9, 0.99),
                               weight_decay=0.0)
    generator = torch.Generator().manual_seed(opts.seed * 1_000_003 + layer)
    before = best = output_error(student, held_x, held_y, kwargs)
    best_state = BestWeights(trained, scratch)  # in a scratch file in `scratch`, when given
    order: list[int] = []
    stale = steps = 0
    per_step = min(max(1, opts.step_tokens // held_x.shape[-2]), windows)
    device_type = held_x.device.type
    bf16 = auto_dtype(opts.dtype, str(held_x.device)) == "bfloat16"  # `auto` resolved for this device
    bar = tqdm(total=opts.steps, desc=f"transfer layer {layer}", unit="step", leave=False, disable=not progress)
    try:
        for step in range(opts.steps):
            batch = []
            for _ in range(per_step):
                if not order:
                    order = torch.randperm(windows, generator=generator).tolist()
                batch.append(read(order.pop()))
            x = torch.stack([b[0] for b in batch])
            y = torch.stack([b[1] for b in batch])
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
                out = attend(student, x, kwargs)
            loss = (out.float() - y).pow(2).sum() / y.pow(2).sum()
            loss.backward()  # each tensor stepped as its gradient lands (StepInBackward)
            optimizer.advance()
            steps = step + 1
            bar.update(1)
            if steps % opts.eval_every == 0 or steps == opts.steps:
                score = output_error(student, held_x, held_y, kwargs)
                bar.set_postfix(heldout=f"{score:.4f}", start=f"{before:.4f}")
                if score < best:
                    best, stale = score, 0
                    best_state.save()
                else:
                    stale += 1
                    if opts.patience and stale >= opts.patience:
                        break
        best_state.restore()
    finally:
        bar.close()
        optimizer.remove()
        best_state.close()
        for p in trained:
            p.requires_grad_(False)
    return {"transfer_before": before, "transfer_after": best, "transfer_steps": float(steps)}


def transfer_merged_layer(cls: type, config: dict, grouped_config: dict, layer: int, kwargs: dict,
                          original: dict[str, torch.Tensor], merged: dict[str, torch.Tensor], windows: int,
                          read_input: Callable[[int], torch.Tensor], held_x: torch.Tensor, scratch: Path,
                          opts: TransferOptions, device="cpu", progress: bool = True,
                          read_target: Callable[[int], torch.Tensor] | None = None,
                          held_targets: torch.Tensor | None = None,
                          student: Callable[[], nn.Module] | None = None,
                          select: Callable[[str], bool] | None = None) -> tuple[nn.Module, dict[str, float]]:
    """One layer: the student (`merged` over `original`, `grouped_config`; or what `student()` builds, training the
    parameters `select` picks) is trained by `transfer_layer` to give the targets: `read_target(w)` /
    `held_targets` where given (the original model's attention outputs on its own inputs, while `read_input` gives
    the converted model's), else the teacher's (original weights, `config`) on the same inputs, written to a
    scratch file in `scratch` (removed on the way out). Returns the trained student attention (its parameters
    named as in `original`, or as `student()` names them) and the errors."""
    how = attention_implementation(config)
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    held_x = held_x.to(device)
    with contextlib.ExitStack() as stack:
        stack.enter_context(heap_kept())  # the same activations at every step: allocate them once
        if read_target is None:
            teacher = build_attention(cls, config, layer, original, how, device)
            fd, path = tempfile.mkstemp(prefix="transfer-targets-", suffix=".f32", dir=scratch)
            stack.callback(os.unlink, path)
            file = stack.enter_context(os.fdopen(fd, "r+b", buffering=0))
            targets = None
            with torch.no_grad():
                for w in range(windows):
                    y = attend(teacher, read_input(w).to(device)[None], kwargs)[0]
                    if targets is None:
                        targets = WindowStates(file, path, tuple(y.shape))
                    targets.write(w, y)
                held_targets = torch.stack([attend(teacher, x[None], kwargs)[0] for x in held_x])
            del teacher
            read_target = lambda w: targets.read(w, device)[0]  # noqa: E731
        elif held_targets is None:
            raise ValueError("read_target needs held_targets")
        module = (student() if student is not None
                  else build_attention(cls, grouped_config, layer, {**original, **merged}, how, device))
        errors = transfer_layer(module, kwargs, windows, lambda w: (read_input(w).to(device), read_target(w)),
                                held_x, held_targets.to(device), opts, layer, progress, select, scratch)
    return module, errors

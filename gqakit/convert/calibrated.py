"""The calibration pass of `--calibration`: the model is run layer by layer on the calibration windows
(`calibration.runner`), each layer's statistics wait on disk for the write pass's merge, and with a transfer
method each layer is merged and trained while its inputs are at hand (`methods.transfer`). Under torchrun the
layers' training is shared out (`layer_share.py`): every process calibrates, each trains the layers it owns."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

from gqakit.common import launcher
from gqakit.common.devices import check_device
from gqakit.common.errors import GqakitError, opt
from gqakit.convert.memory import release_freed_memory
from gqakit.convert import methods
from gqakit.convert.calibration.data import CalibrationData, load_calibration, sample_calibration
from gqakit.convert.calibration.runner import LayerInputs, calibrate
from gqakit.convert.calibration.stored import layer_path, load_layer
from gqakit.convert.layer_share import Share, barrier, meeting_folder, read_errors, write_errors
from gqakit.convert.latent.student import latent_student, set_norm_from, trained
from gqakit.convert.methods.engine import (LayerMerge, attention_key, made_latent, merge_checkpoint_layer,
                                          transferred_path)
from gqakit.convert.methods.transfer import transfer_merged_layer
from gqakit.convert.options import ConvertConfig, TransferOptions, calibration_tokens, transfer_options
from gqakit.convert.output import new_config
from gqakit.convert.plan import Plan
from gqakit.hf.architectures.latent import ATTENTION
from gqakit.hf.checkpoint import load_tensor
from gqakit.hf.headers import TensorInfo


def open_calibration(cfg: ConvertConfig, model_dir: Path, config: dict, share: Share = Share()
                     ) -> CalibrationData | None:
    """The calibration windows `cfg` asks for: --calibration DATA's, or, for a method that needs calibration and
    got none, the model's own samples (not on a --dry-run, which reads no weights); None for a method without
    calibration. The device is checked first."""
    method = methods.get(cfg.method)
    if cfg.calibration is None and (method.calibration != "required" or cfg.dry_run):
        return None
    device = check_device(cfg.calibration_device, "calibration_device")
    if cfg.calibration is not None:
        return load_calibration(cfg.calibration, model_dir, config, calibration_tokens(cfg), cfg.calibration_window,
                                cfg.text_column)
    if share.world > 1:
        raise GqakitError(f"under torchrun every process must calibrate on the same text: pass "
                          f"{opt('calibration', 'DATA')} (e.g. drawn once by `gqakit sample`)")
    if share.main:
        print(f"{opt('method', cfg.method)} without {opt('calibration')}: calibrating on {calibration_tokens(cfg):,} "
              f"tokens sampled from the model itself (seed {cfg.seed}); pass {opt('calibration', 'TEXT')} to use "
              "text of its domain", file=sys.stderr, flush=True)
    return sample_calibration(model_dir, config, calibration_tokens(cfg), cfg.calibration_window, cfg.seed, device,
                              cfg.progress)


def calibrate_layers(cfg: ConvertConfig, plan: Plan, config: dict, tensors: dict[str, TensorInfo],
                     calibration: CalibrationData, how: LayerMerge, folder: Path, errors: dict[int, dict[str, float]],
                     share: Share = Share()) -> LayerMerge:
    """One pass, layer by layer, into `folder` (inside the temporary output): each layer's statistics wait in
    their file there; with a transfer method each layer is merged and trained (its tensors left in `folder`, its
    errors in `errors`). Returns `how` reading from `folder`."""
    transfer = methods.get(plan.method).transfer
    how = dataclasses.replace(how, stats=folder, transferred=transfer)
    how.stats.mkdir()
    meeting_folder(share, how.stats)  # under torchrun: where the other processes leave their layers
    device = calibration_device(cfg, share)
    opts = transfer_options(cfg) if transfer else None
    if opts is not None and opts.dtype == "bfloat16" and str(device).startswith("cpu") and share.rank == 0:
        from gqakit.common.precision import warn_if_slow_bf16

        warn_if_slow_bf16("convert-gqa", "--transfer-dtype bfloat16", "--transfer-dtype float32")
    for layer in calibrate(config, plan.spec, tensors, calibration.windows, calibration.heldout, how.stats,
                           device, cfg.progress, with_inputs=transfer,
                           converted_inputs=transfer and opts.inputs == "converted"):
        if transfer:  # while the layer's inputs are at hand: merge it, then train it
            if share.owns(layer.index):
                transfer_layer_at_hand(layer, plan, config, tensors, how, opts, errors, device, cfg.progress)
            layer_path(how.stats, layer.index).unlink()  # its statistics are done with
        # else each layer's statistics are in their file in how.stats when its index is yielded
    if transfer and share.world > 1:
        barrier(share)  # every process has left its layers in how.stats
        errors.update(read_errors(how.stats, range(plan.num_layers), share))
    release_freed_memory()  # the calibration model's heap goes back to the OS before the merge
    return how


def calibration_device(cfg: ConvertConfig, share: Share) -> str:
    device = cfg.calibration_device
    if share.world > 1 and device == "cuda":  # one GPU per process, as torchrun numbers them
        device = f"cuda:{launcher.local_rank()}"
    return device


def transfer_layer_at_hand(inputs: LayerInputs, plan: Plan, config: dict, tensors: dict[str, TensorInfo],
                           how: LayerMerge, opts: TransferOptions, errors: dict[int, dict[str, float]], device,
                           progress: bool, into: Path | None = None) -> None:
    """Merge layer `inputs.index` by the calibrated merge training starts from (`fit`, or `aligned` with
    `--transfer-start aligned`), train it (`methods.transfer`), and leave its attention tensors in
    `transferred_path` of `into` (default: the statistics folder), read back by the write pass; its errors go
    to `errors`."""
    from safetensors.torch import save_file

    i = inputs.index
    op = next(op for op in plan.ops if op.kind in ("attn", "latent") and op.layer == i)
    heldout = load_layer(how.stats, i, ())[1]
    start_plan = dataclasses.replace(plan, method=opts.start)  # the calibrated merge that training starts from
    if plan.latent_trained:  # the latent layer itself is trained, from its fit or the merge embedded bias-free
        merged, cost = latent_start(plan, start_plan, tensors, i, op.sources, how, heldout)
    else:
        merged, cost = merge_checkpoint_layer(start_plan, tensors, i, op.sources, how, heldout)
    prefix = plan.spec.q_proj.format(i=i).rpartition(".")[0] + "."  # "model.layers.3.self_attn."
    original = {name[len(prefix):]: load_tensor(info, name) for name, info in tensors.items()
                if name.startswith(prefix)}
    grouped = new_config(config, plan, "auto")
    student, select, names = None, None, list(merged)
    if plan.latent_trained:
        start = {name[len(ATTENTION.format(i=i)):]: t for name, t in merged.items()}
        merged = {}  # held by `start` alone, which the student empties once it holds its own copies

        def student():
            module = latent_student(grouped, plan.latent, plan.num_layers, i, start, device)
            start.clear()
            if not plan.latent.bias:  # the norm's weight from the first fitting windows' latents
                set_norm_from(module, torch.stack([inputs.read(w) for w in range(min(8, inputs.windows))]))
            return module

        select = trained(opts.params, plan.latent)
        prefix = ATTENTION.format(i=i)
    trained_module, cost_transfer = transfer_merged_layer(
        inputs.attention_class, config, grouped, i, inputs.attention_kwargs, original,
        {name[len(prefix):]: t for name, t in merged.items()}, inputs.windows, inputs.read, heldout["x"],
        how.stats, opts, device, progress, inputs.read_target, inputs.held_targets, student, select)
    inputs.trained_attention = trained_module  # with --transfer-inputs converted, the next layer reads through it
    params = dict(trained_module.named_parameters())
    save_file({name: params[name[len(prefix):]].detach().cpu().contiguous() for name in names},
              str(transferred_path(into or how.stats, i)))
    errors.setdefault(i, {}).update({**cost, **cost_transfer})


def latent_start(plan: Plan, start_plan: Plan, tensors: dict[str, TensorInfo], i: int, sources: tuple[str, ...],
                 how: LayerMerge, heldout: dict) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The latent layer that training starts from (float32, the target's names): fitted to the source's K/V heads
    (--kv-rank / --rope-dim) in the metric of the layer's calibration statistics, or else `start_plan`'s calibrated
    MQA merge held bias-free; and the card's errors."""
    names = {attention_key(plan, i, name): name for name in sources}  # "q_w", "k_b", ... -> checkpoint name
    cost: dict[str, float] = {}
    if plan.latent_fit:
        parts = {key: load_tensor(tensors[name], name) for key, name in names.items()}
    else:
        merged, cost = merge_checkpoint_layer(start_plan, tensors, i, sources, how, heldout)
        parts = {key: merged[name] for key, name in names.items()}
    return made_latent(plan, i, parts, torch.float32, cost, how), cost


def transfer_share(cfg: ConvertConfig, plan: Plan, config: dict, tensors: dict[str, TensorInfo],
                    calibration: CalibrationData, share: Share) -> None:
    """A process other than rank 0 under torchrun: calibrate in a scratch folder of its own, inside rank 0's
    temporary output folder, train the layers it owns and leave them (with their errors) beside rank 0's."""
    meeting = meeting_folder(share, None)
    own = meeting / f"rank-{share.rank}"
    own.mkdir()
    how = LayerMerge(grouping=cfg.grouping or "similarity", stats=own, transferred=True)
    opts, device = transfer_options(cfg), calibration_device(cfg, share)
    errors: dict[int, dict[str, float]] = {}
    for layer in calibrate(config, plan.spec, tensors, calibration.windows, calibration.heldout, own, device,
                           False, with_inputs=True):
        if share.owns(layer.index):
            transfer_layer_at_hand(layer, plan, config, tensors, how, opts, errors, device, False, into=meeting)
            write_errors(meeting, layer.index, errors[layer.index])
        layer_path(own, layer.index).unlink()  # its statistics are done with
    barrier(share)

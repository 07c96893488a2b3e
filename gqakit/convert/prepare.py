"""Everything a conversion checks and plans before it reads a weight: the options, the family, the output folder,
the plan and the launch. Torch-free, so `convert-gqa --dry-run` prints the plan without loading torch; the
calibration data (which needs torch and the tokenizer) is opened only when the run will use it, and a dry run
checks it without either where it can (`calibration/check.py`)."""
from __future__ import annotations

import sys
from pathlib import Path

from gqakit.common.devices import check_device, check_device_name
from gqakit.common.errors import GqakitError, opt
from gqakit.convert import methods
from gqakit.convert.calibration.check import calibration_window
from gqakit.convert.layer_share import Share, check_share, launched_share
from gqakit.convert.options import ConvertConfig, calibration_tokens, check_options, transfer_options
from gqakit.convert.output import check_output, max_shard_bytes, output_path, written_config
from gqakit.convert.plan import Plan, check_family, make_plan
from gqakit.hf.folder import custom_code, read_config
from gqakit.hf.headers import TensorInfo, scan_checkpoint


def uses_calibration(cfg: ConvertConfig) -> bool:
    """Whether the run opens calibration windows: --calibration given, or a method that requires them (its own
    samples), except on a --dry-run, which reads no weights."""
    return cfg.calibration is not None or (methods.get(cfg.method).calibration == "required" and not cfg.dry_run)


def prepare(cfg: ConvertConfig, share: Share = Share()):
    """Validate everything a conversion needs and plan it, before any output is written: (plan, config, tensors,
    output folder, calibration data or None)."""
    model_dir = Path(cfg.model_dir)
    config = read_config(model_dir)
    check_family(config)  # a refused family is named before anything else is looked at
    if (custom := custom_code(config)) is not None:
        print(f"convert-gqa: config.json maps {custom} to custom code (auto_map), which gqakit never runs; the "
              "output is transformers' stock class, as transformers builds it without trust_remote_code (auto_map "
              "and .py files are not carried over)", file=sys.stderr)
    out = output_path(model_dir, cfg.output_dir, cfg.groups, cfg.to)
    check_options(cfg)
    if uses_calibration(cfg):  # before any header is read
        check_device(cfg.calibration_device, "calibration_device")
    elif cfg.dry_run and methods.get(cfg.method).calibration == "required":  # the name: the run may be elsewhere
        check_device_name(cfg.calibration_device, "calibration_device")
    max_shard = max_shard_bytes(cfg.max_shard_size)
    tensors: dict[str, TensorInfo] = scan_checkpoint(model_dir)
    plan = make_plan(config, tensors, cfg.groups, cfg.method, cfg.dtype, max_shard, cfg.pool_encoder, cfg.to,
                     cfg.kv_rank, cfg.rope_dim, cfg.bias_free)
    if plan.rehosted is not None:  # from here on the checkpoint is the target class's
        config, tensors = plan.rehosted.config, plan.rehosted.tensors
    if cfg.grouping is not None and plan.groups == 1:  # (G >= K merges nothing: refused with the method)
        raise GqakitError(f"{opt('grouping')} picks which of the {plan.num_key_value_heads} K/V heads share a group, "
                          f"and at {opt('groups', 1)} one group holds them all; drop {opt('grouping')}")
    if cfg.calibration is None and methods.get(cfg.method).calibration == "required":  # the model's own samples:
        calibration_window(config, calibration_tokens(cfg), cfg.calibration_window)  # checked before any sampling
    check_output(model_dir, out, cfg.force)  # reads paths only: a dry run refuses the -o the run would refuse
    if not cfg.dry_run:  # every weight the output's class needs is written, at its shape (the class on meta)
        from gqakit.hf.expected import check_complete

        check_complete(written_config(config, plan, cfg.dtype), {op.name: op.shape for op in plan.ops}, str(model_dir))
    calibration = None
    if uses_calibration(cfg) and not cfg.dry_run:
        from gqakit.convert.calibrated import open_calibration

        calibration = open_calibration(cfg, model_dir, config, share)
    return plan, config, tensors, out, calibration


def check_launch(cfg: ConvertConfig, plan: Plan, share: Share) -> None:
    """Refuse a launch of several processes that this conversion cannot share out (`layer_share.check_share`)."""
    transfer = methods.get(plan.method).transfer
    check_share(share, transfer, transfer_options(cfg).inputs if transfer else "", cfg.dry_run)


def planned(cfg: ConvertConfig) -> tuple[dict, tuple, Share]:
    """The checks and the plan of a run: (its summary, what `prepare` returned, the launch's share). A dry run's
    summary holds, for --calibration DATA, the line that says how far the data was checked ("calibration_check")."""
    share = launched_share()
    prepared = prepare(cfg, share)
    plan, config, _, out, calibration = prepared
    check_launch(cfg, plan, share)
    summary = {"plan": plan, "output_dir": out, "errors": {}, "calibration": calibration}
    if cfg.dry_run and cfg.calibration is not None:
        from gqakit.convert.calibration.check import dry_run_check

        summary["calibration_check"] = dry_run_check(cfg.calibration, Path(cfg.model_dir), config,
                                                      calibration_tokens(cfg), cfg.calibration_window,
                                                      cfg.text_column)
    return summary, prepared, share

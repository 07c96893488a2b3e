"""Carry out a conversion: validate, plan, stream tensors through the merge method, publish atomically.

The driver only: the options and their checks are `options.py`, what is checked and planned before any weight is
read `prepare.py`, the plan `plan.py`, where and what is written `output.py`, the calibration pass
`calibrated.py`, each output tensor `methods/engine.py`, the card `card.py`."""
from __future__ import annotations

import dataclasses
import json
import shutil
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm.auto import tqdm

from gqakit.common import fitted
from gqakit.common.atomic import atomic_output
from gqakit.common.errors import GqakitError
from gqakit.convert.calibrated import calibrate_layers, transfer_share
from gqakit.convert.calibration.data import CalibrationData
from gqakit.convert.card import write_card
from gqakit.convert.layer_share import Share, finish, start
from gqakit.convert.methods.engine import LayerMerge, compute, merges_ahead
from gqakit.convert.options import ConvertConfig
from gqakit.convert.output import written_config
from gqakit.convert.plan import Plan
from gqakit.convert.prepare import planned
from gqakit.hf.checkpoint import ShardWriter
from gqakit.hf.folder import copy_side_files
from gqakit.hf.headers import TensorInfo

LOOKAHEAD = 2  # regrouped tensors computed ahead of the writer


def convert(cfg: ConvertConfig, command: str = "") -> dict:
    """Run a conversion end to end; returns a summary (also what the card records). Under torchrun, attention
    transfer's layers are split over the processes (`layer_share.py`); rank 0 writes the output. A --dry-run
    returns after the plan (`prepare.planned`, which loads no torch)."""
    summary, (plan, config, tensors, out, calibration), share = planned(cfg)
    if cfg.dry_run:
        return summary
    start(share)
    try:
        if share.main:
            summary["errors"] = _write(cfg, plan, config, tensors, out, command, calibration, share)
        else:
            transfer_share(cfg, plan, config, tensors, calibration, share)
    except OSError as e:
        raise GqakitError(f"writing {out} failed ({e.strerror or e}); nothing was written: fix the cause "
                          "(disk space, permissions) and run again") from None
    finally:
        finish(share)
    return summary


def _write(cfg: ConvertConfig, plan: Plan, config: dict, tensors: dict[str, TensorInfo], out: Path,
           command: str, calibration: CalibrationData | None = None, share: Share = Share()
           ) -> dict[int, dict[str, float]]:
    std = plan.initializer_range
    errors: dict[int, dict[str, float]] = {}
    layers: dict[int, dict[str, torch.Tensor]] = {}  # aligned merges: a layer's tensors not yet written
    entries = [(o.name, o.dtype, o.shape) for o in plan.ops]
    with atomic_output(out, cfg.force) as tmp:
        how = LayerMerge(grouping=cfg.grouping or "similarity")
        if calibration is not None:  # one pass, layer by layer; statistics wait on disk, one file per layer
            how = calibrate_layers(cfg, plan, config, tensors, calibration, how, tmp / ".calibration", errors, share)
        ahead = merges_ahead(plan, tensors, how)
        how = dataclasses.replace(how, ahead=ahead)
        writer = ShardWriter(tmp, entries, plan.max_shard_bytes)
        # One worker thread computes the next regrouped tensors while this thread streams byte copies
        # (torch kernels and copy_file_range both release the GIL). At most LOOKAHEAD results wait,
        # so memory stays a few tensors.
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending: deque = deque()
            todo = iter(op for op in plan.ops if op.kind != "copy")

            def refill() -> None:
                while len(pending) < LOOKAHEAD and (op := next(todo, None)) is not None:
                    pending.append(pool.submit(compute, op, plan, tensors, std, cfg.seed, errors, layers, how))

            try:
                refill()
                for op in tqdm(plan.ops, desc="convert", unit="tensor", disable=not cfg.progress):
                    if op.kind == "copy":
                        writer.copy_tensor(op.name, tensors[op.sources[0]])
                    else:
                        writer.write_tensor(op.name, pending.popleft().result())
                        refill()
            finally:
                for future in pending:  # only on the way out of an error or an interrupt: do not wait for them
                    future.cancel()
                if ahead is not None:  # merges still running read files in tmp: they end before it goes
                    ahead.close()
        writer.finish()
        if how.stats is not None:
            shutil.rmtree(how.stats)
        (tmp / "config.json").write_text(json.dumps(written_config(config, plan, cfg.dtype), indent=2) + "\n",
                                         encoding="utf-8")
        copy_side_files(Path(cfg.model_dir), tmp)  # the source's record of fitted texts among them
        if calibration is not None and cfg.calibration:
            fitted.add(tmp, fitted.entries([cfg.calibration], "calibration"))
        write_card(tmp / "README.md", cfg, plan, errors, command, calibration)
    return errors

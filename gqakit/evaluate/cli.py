"""`gqakit eval ppl | stream | passkey | niah`: flags -> the command's frozen dataclass -> its runner.

    gqakit eval ppl MODEL [MODEL ...] --text FILE [--max-length L] [--stride S] [--bos] [--attention KIND]
    gqakit eval stream MODEL --text FILE --tokens N --policy sinks --policy recompute [--window W] [--sinks S]
    gqakit eval passkey MODEL --lengths 1k,2k,4k --depths 0,0.25,0.5,0.75,1 --trials 5 --seed 0
    gqakit eval niah MODEL [MODEL ...] --tasks niah_single,niah_multikey,vt --lengths 1k,2k --samples 10 --seed 0

Every run writes a report folder (results.json, results.csv, a plot): `--output DIR`, by default
`runs/eval-<kind>-<timestamp>`; an existing folder needs `--force`. The flags are declared once, on the fields
of `evaluate/options.py`. No heavy import happens here.
"""
from __future__ import annotations

import argparse

from gqakit.common.devices import check_device
from gqakit.common.options import add_arguments, from_args, typed
from gqakit.evaluate.options import NiahConfig, PasskeyConfig, PplConfig, StreamConfig


def _device_checked(cfg):
    """`cfg` once its --device exists here (`common.devices.check_device`): before any model or text is read."""
    check_device(cfg.device, "device", auto=True)
    return cfg


def _run_ppl(args: argparse.Namespace, command: str) -> None:
    from gqakit.evaluate.perplexity import run_ppl

    run_ppl(_device_checked(from_args(PplConfig, args)), command=command)


def _run_stream(args: argparse.Namespace, command: str) -> None:
    from gqakit.evaluate.stream import run_stream

    run_stream(_device_checked(from_args(StreamConfig, args, given=typed(StreamConfig, args))), command=command)


def _run_passkey(args: argparse.Namespace, command: str) -> None:
    from gqakit.evaluate.passkey import run_passkey

    run_passkey(_device_checked(from_args(PasskeyConfig, args)), command=command)


def _run_niah(args: argparse.Namespace, command: str) -> None:
    from gqakit.evaluate.niah import run_niah

    run_niah(_device_checked(from_args(NiahConfig, args)), command=command)


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    """Add `eval` (with `ppl`, `stream`, `passkey`, `niah`) to an argparse subparsers object; returns `eval`'s parser.

    Each leaf sets `func(args, command)`, the convention of `gqakit.cli`, and `options`, its dataclass.
    """
    ev = subparsers.add_parser("eval", help="perplexity, long-context fluency, passkey and needle retrieval "
                                            "(with reports)",
                               description="Evaluate models; every run writes JSON, CSV and a plot.")
    sub = ev.add_subparsers(dest="eval_command", required=True, metavar="{ppl,stream,passkey,niah}")
    for name, cls, run, what in (
            ("ppl", PplConfig, _run_ppl, "token-weighted strided perplexity of one or more models (a comparison "
                                         "table)"),
            ("stream", StreamConfig, _run_stream, "long-context fluency: perplexity by position under KV-cache "
                                                  "policies"),
            ("passkey", PasskeyConfig, _run_passkey, "passkey retrieval accuracy per (length, depth), with a "
                                                     "heatmap"),
            ("niah", NiahConfig, _run_niah, "RULER-style needle retrieval and variable tracking per (task, length, "
                                            "depth)")):
        leaf = sub.add_parser(name, help=what)
        add_arguments(leaf, cls)
        leaf.set_defaults(func=run, options=cls)
    return ev

"""The command line: one thin layer over the subpackages (no maths here).

    convert-gqa --groups 8 MODEL_DIR           (same as `gqakit convert ...`)
    gqakit demo
    gqakit generate MODEL --attention sinks --sinks 4 --window 1020 --prompt-file F
    gqakit eval ppl|stream|passkey MODEL ...
    gqakit uptrain RECIPE.yaml [key=value ...]   (also under torchrun / accelerate launch)
    gqakit tokenize DATA... -o TOKENS --tokenizer MODEL   (a token cache that uptrain's data: can name)
    gqakit sample MODEL -o SAMPLES.jsonl --tokens 65536   (calibration text drawn from the model itself)
    gqakit uptrain RECIPE.yaml --plan --processes 8 --device-memory 80GB   (memory per rank; trains nothing)
"""
from __future__ import annotations

import argparse
import dataclasses
import errno
import shlex
import sys
import time

from gqakit import __version__
from gqakit.convert import methods
from gqakit.common import launcher
from gqakit.common.atomic import Terminated, sigterm_as_interrupt
from gqakit.common.errors import GqakitError, spelled
from gqakit.common.report import counted
from gqakit.common.options import (FieldError, add_arguments, drop_given, flags, from_args, strict_parser,
                                   replace, typed, typed_values)
from gqakit.demo_options import DemoConfig
from gqakit.evaluate.cli import add_eval_parser
from gqakit.uptrain.data.options import TokenizeConfig


def _add_convert_args(p: argparse.ArgumentParser) -> None:
    from gqakit.convert.options import ConvertConfig

    add_arguments(p, ConvertConfig)
    p.set_defaults(func=_run_convert, options=ConvertConfig)


def _run_convert(args: argparse.Namespace, command: str) -> None:
    from gqakit.convert.card import against_mean, describe_plan, kv_summary
    from gqakit.convert.options import ConvertConfig

    cfg = from_args(ConvertConfig, args, given=typed(ConvertConfig, args))  # refused where the method ignores it
    if cfg.dry_run:  # the checks and the plan alone: no torch
        from gqakit.convert.prepare import planned

        result = planned(cfg)[0]
    else:
        from gqakit.convert import convert
        from gqakit.convert.memory import return_freed_memory_eagerly

        if cfg.method in methods.LAYERWISE:  # the layer merges and calibration allocate many large temporaries
            return_freed_memory_eagerly()
        result = convert(cfg, command=command)
    plan = result["plan"]
    if launcher.rank():
        return  # under torchrun rank 0 writes the output and reports it
    if cfg.dry_run:
        _report(describe_plan(plan))
        if result.get("calibration_check"):
            _report(result["calibration_check"])
        _report(f"dry run: nothing written (would write {result['output_dir']})")
    else:
        what = (f"{plan.num_key_value_heads} K/V heads -> a fitted latent (MLA)" if plan.latent_fit else
                f"{plan.num_key_value_heads} -> {plan.groups} K/V heads ({plan.method})"
                + (", as latent attention (MLA)" if plan.latent else ""))
        _report(f"wrote {result['output_dir']}: {what}; {kv_summary(plan)}")
        warning = against_mean(plan, result["errors"], result["calibration"] is not None)
        if warning:
            _say(f"{command.split(' ', 1)[0]}: warning: {warning}")  # the command begins with its program


def _run_demo(args: argparse.Namespace, command: str) -> None:
    from gqakit.demo import run_demo

    run_demo(**dataclasses.asdict(from_args(DemoConfig, args)), command=command)


def _run_generate(args: argparse.Namespace, command: str) -> None:
    from gqakit.generate import GenerateConfig, generate

    # GenerateConfig refuses an option it would ignore, typed even at its default value
    generate(from_args(GenerateConfig, args, given=typed(GenerateConfig, args)))


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    from gqakit.generate import GenerateConfig

    add_arguments(p, GenerateConfig)
    p.set_defaults(func=_run_generate, options=GenerateConfig)


def _run_uptrain(args: argparse.Namespace, command: str) -> None:
    from gqakit.common.recipes import load_recipe
    from gqakit.uptrain.config import UptrainConfig  # without torch: a bad recipe is refused at once

    overrides = list(args.overrides)
    budget = ("alpha", "tokens", "steps")
    given = {o.partition("=")[0] for o in overrides}
    if given & set(budget):  # a budget on the command line replaces the recipe's
        overrides = [f"{k}=null" for k in budget if k not in given] + overrides
    cfg = load_recipe(UptrainConfig, args.recipe, overrides)
    flags_typed = typed_values(UptrainConfig, args)  # --context-parallel, --device-memory, --force, -q
    if flags_typed:
        cfg = replace(cfg, flags_typed)
    if args.plan:  # arithmetic from config.json alone: no data, tokenizer or output folder needed
        from gqakit.uptrain.memory_plan import describe_memory_plan

        if flags_typed.get("force") or ("force" in given and cfg.force):  # typed, not the recipe's own
            raise GqakitError("--force does nothing with --plan (the plan writes nothing and keeps no run folder); "
                              "drop --force, or drop --plan to start the run over")

        print(describe_memory_plan(cfg, args.processes))
        return
    if args.processes is not None:
        raise GqakitError("--processes only applies with --plan; a run's world size is the launcher's "
                          "(torchrun --nproc_per_node N ...)")
    from gqakit.uptrain.loop import uptrain

    record = uptrain(cfg, command=command)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # every rank has passed uptrain's last barrier
        dist.destroy_process_group()  # a rank that exits with the group alive may abort in gloo's teardown
    if launcher.rank():
        return  # one report per run, from rank 0
    if record.get("final_eval_ppl") is not None and record.get("initial_eval_ppl") is not None:
        print(f"held-out perplexity {record['initial_eval_ppl']:.2f} -> {record['final_eval_ppl']:.2f}")
    _report(f"wrote {cfg.output_dir}: {counted(record['budget']['steps'], 'step')}, "
            f"{counted(record['budget']['tokens'], 'token')} "
          f"({record['budget']['source']}) in {record['train_seconds']:.0f} s")


def _run_sample(args: argparse.Namespace, command: str) -> None:
    from gqakit.convert.calibration.sample import SampleConfig, sample

    done = sample(from_args(SampleConfig, args))
    _report(f"wrote {done['output']}: {counted(done['samples'], 'sample')} of the model's own text, "
            f"{counted(done['tokens'], 'token')} in {done['seconds']:.1f} s")


def _run_tokenize(args: argparse.Namespace, command: str) -> None:
    from gqakit.uptrain.data.token_build import tokenize_to

    cfg = from_args(TokenizeConfig, args)
    header = tokenize_to(list(cfg.data), cfg.output, cfg.tokenizer, num_proc=cfg.num_proc,
                         text_column=cfg.text_column, force=cfg.force, progress=cfg.progress)
    _report(f"wrote {cfg.output}: {counted(header['tokens'], 'token')}, {counted(header['documents'], 'document')} "
            f"in {header['seconds']:.1f} s")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gqakit", description="Turn multi-head-attention models into grouped-query "
                                     "ones, run efficient attention, uptrain and evaluate them (see README.md).")
    parser.add_argument("--version", action="version", version=f"gqakit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="MHA -> GQA/MQA checkpoint conversion (same as convert-gqa)")
    _add_convert_args(conv)
    demo = sub.add_parser("demo", help="convert the embedded model to G=4,2,1 and compare perplexity")
    add_arguments(demo, DemoConfig)
    demo.set_defaults(func=_run_demo, options=DemoConfig)
    gen = sub.add_parser("generate", help="stream text, far past the trained context with a sink cache")
    _add_generate_args(gen)
    up = sub.add_parser("uptrain", help="uptrain a converted model from a YAML recipe (accelerate, torchrun)")
    up.add_argument("recipe", help="YAML recipe (see recipes/); keys map onto gqakit.uptrain.UptrainConfig")
    up.add_argument("overrides", nargs="*", metavar="key=value", help="override recipe keys, e.g. steps=20 lr=1e-4")
    from gqakit.uptrain.config import UptrainConfig  # torch-free

    add_arguments(up, UptrainConfig)  # the recipe keys that are also flags
    up.add_argument("--plan", action="store_true",
                    help="print the per-rank memory plan (parameters, gradients, optimizer, activations) and whether "
                         "it fits, then exit without training or writing anything")
    up.add_argument("--processes", type=int, default=None, metavar="N",
                    help="with --plan: the world size to plan for (default: the recipe's num_processes, or 1)")
    up.set_defaults(func=_run_uptrain,
                    interrupted="the checkpoints written so far are kept (none before the first checkpoint_every "
                                "steps): run the same command again to resume from the last")
    tok = sub.add_parser("tokenize", help="tokenise training data once into a token cache "
                                          "(see gqakit.uptrain.data.token_build)")
    add_arguments(tok, TokenizeConfig)
    tok.set_defaults(func=_run_tokenize, options=TokenizeConfig, interrupted="nothing was written")
    from gqakit.convert.calibration.sample import SampleConfig  # torch-free

    samp = sub.add_parser("sample", help="calibration text sampled from the model itself (convert-gqa --calibration)")
    add_arguments(samp, SampleConfig)
    samp.set_defaults(func=_run_sample, options=SampleConfig, interrupted="nothing was written")
    add_eval_parser(sub)
    return parser


def _dispatch(parser: argparse.ArgumentParser, argv: list[str], prog: str) -> int:
    strict_parser(parser)
    args, extra = parser.parse_known_args(argv)
    drop_given(args)
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]  # key=value overrides after the options
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    command = " ".join([prog, *map(shlex.quote, argv)])
    note = getattr(args, "interrupted", "nothing was written")
    try:
        with sigterm_as_interrupt(), spelled(flags(args.options) if getattr(args, "options", None) else {}):
            args.func(args, command)  # errors name the flags typed; SIGTERM cleans up as Ctrl-C does
    except GqakitError as e:
        e = _as_typed(e, getattr(args, "options", None))
        rank = launcher.rank()
        if rank:  # under torchrun every rank fails alike and rank 0 says it; but when this rank gets there first and
            # exits, torchrun stops rank 0 before it can: wait (torchrun stops this rank once rank 0 has exited),
            # then say it here, so that an error is never silent (one this rank alone meets, or a slow rank 0)
            time.sleep(_OTHER_RANKS_WAIT_S)
            _say(f"{parser.prog}: error (rank {rank}): {e}")
        else:
            _say(f"{parser.prog}: error: {e}")
        return 2
    except OSError as e:
        if e.errno not in _ENVIRONMENT:
            raise  # not a state of the machine the user can fix: a bug, keep its traceback
        where = f" ({e.filename})" if e.filename else ""
        _say(f"{parser.prog}: error: {_ENVIRONMENT[e.errno]}{where}; {note}")
        return 2
    except KeyboardInterrupt as e:
        terminated = isinstance(e, Terminated)
        _say(f"{parser.prog}: {'terminated' if terminated else 'interrupted'}; {note}")
        return 143 if terminated else 130
    return 0


def _as_typed(error: GqakitError, options) -> GqakitError:
    """A field's range error (`field=value must be ...`, from the options' checks) spelt as the flag was typed
    (`--flag value must be ...`), for a command whose flags are declared on `options`."""
    flag = flags(options).get(error.field) if isinstance(error, FieldError) and options is not None else None
    return GqakitError(str(error).replace(f"{error.field}=", f"{flag} ", 1)) if flag else error


_OTHER_RANKS_WAIT_S = 15  # seconds a rank other than 0 waits for rank 0 to say a shared error

# Failures of the machine rather than of gqakit: one line with the fix, like any user error.
_ENVIRONMENT = {
    errno.ENOSPC: "no space left on the device; free space or write to another disk",
    errno.EDQUOT: "disk quota exceeded; free space or write to another disk",
    errno.EFBIG: "a file would pass the size limit (ulimit -f) or the file system's; raise it or write elsewhere",
    errno.EROFS: "the file system is read-only; write to another folder",
    errno.EACCES: "permission denied; fix the permissions or write to another folder",
    errno.EPERM: "operation not permitted; fix the permissions or write to another folder",
}


def _say(line: str, stream=None) -> None:
    """One line (stderr by default), whatever bytes a path in it holds: non-UTF-8 names are escaped."""
    stream = stream or sys.stderr
    stream.write(line.encode("utf-8", "backslashreplace").decode("utf-8", "replace").replace("\n", " ") + "\n")
    stream.flush()


def _report(text: str) -> None:
    """The result on stdout, each line escaped like `_say`'s (a written path may not be UTF-8)."""
    for line in text.splitlines():
        _say(line, sys.stdout)


def main(argv: list[str] | None = None) -> int:
    """`gqakit SUBCOMMAND ...`"""
    argv = sys.argv[1:] if argv is None else argv
    return _dispatch(build_parser(), argv, "gqakit")


def convert_main(argv: list[str] | None = None) -> int:
    """`convert-gqa ...`: the same as `gqakit convert ...`."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="convert-gqa", description="MHA -> GQA/MQA checkpoint conversion")
    _add_convert_args(parser)
    return _dispatch(parser, argv, "convert-gqa")


if __name__ == "__main__":
    sys.exit(main())

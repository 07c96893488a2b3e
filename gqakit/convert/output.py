"""What a conversion writes and where: the -o folder (its default and the checks that keep the user's files safe),
the shard size, and the new config.json."""
from __future__ import annotations

import os
from pathlib import Path

from gqakit.common.atomic import check_replaceable
from gqakit.common.errors import GqakitError, opt
from gqakit.common.sizes import parse_size
from gqakit.convert.plan import Plan
from gqakit.hf.architectures.latent import latent_config


def max_shard_bytes(text: str) -> int:
    """--max-shard-size in bytes."""
    return parse_size(text, opt("max_shard_size"), "5GB, 500MB or 2GiB")


def named(path: Path) -> Path:
    """`path`, or where it ends in `.` or `..` (no name of its own), the real path it stands for."""
    return path.resolve() if path.name in ("", ".", "..") else path


def default_output(model_dir: Path, groups: int, to: str = "gqa") -> Path:
    """MODEL-gqaG (-mqa, -mla) beside the model folder."""
    suffix = "mla" if to == "mla" else "mqa" if groups == 1 else f"gqa{groups}"
    model_dir = named(model_dir)
    return model_dir.with_name(f"{model_dir.name}-{suffix}")


def output_path(model_dir: Path, output_dir: str | None, groups: int, to: str = "gqa") -> Path:
    """The -o folder (or the default), with a final `..` or `.` resolved so that it has a name."""
    return named(Path(output_dir)) if output_dir else default_output(model_dir, groups, to)


def check_output(model_dir: Path, out: Path, force: bool) -> None:
    """Refuse an -o that is, holds or sits inside the model folder, or exists without --force.

    A symlink at -o is itself what --force replaces (the folder it points to is never touched), so
    the link's own location is what must lie outside the model folder.
    """
    src, dst = model_dir.resolve(), out.parent.resolve() / out.name
    if dst == src or src in dst.parents:
        raise GqakitError(f"output {out} is {'the model folder' if dst == src else 'inside the model folder'}; "
                          "choose an -o outside it")
    if dst in src.parents:
        raise GqakitError(f"output {out} contains the model folder; choose an -o that does not")
    if os.path.lexists(out) and not force:
        what = "a symlink" if out.is_symlink() else "a file" if not out.is_dir() else ""
        raise GqakitError(f"output {out} already exists{f' ({what})' if what else ''}; pass {opt('force')} to "
                          "replace it or choose another -o")
    if force:
        check_replaceable(out, kind="model")


def new_config(config: dict, plan: Plan, dtype: str) -> dict:
    """The output's config.json: the source's (or the re-host target's) with the plan's K/V head count, spelled as
    the target class reads it, an explicit head_dim where the class takes one, and the output dtype."""
    config = dict(config)
    config.pop("auto_map", None)  # custom code (and its .py files) is not carried over: the output is the stock class
    if plan.spec.multi_query_key:  # the class reads its K/V head count from this flag
        config[plan.spec.multi_query_key] = plan.groups == 1
    if plan.own_class:  # a G no stock class holds: gqakit's own class, registered by `import gqakit`
        model_type, architecture, kv_key = plan.own_class
        config.update(model_type=model_type, architectures=[architecture])
        config[kv_key] = plan.groups
    for common, own in plan.spec.config_names:  # and this family spells it its own way
        if common == "num_key_value_heads":
            config[own] = plan.groups
    config["num_key_value_heads"] = plan.groups
    if plan.encoder_layers is not None:
        config[plan.spec.encoder_fields[1]] = plan.groups
    if plan.spec.head_dim_field:
        config["head_dim"] = plan.head_dim
    if dtype != "auto":
        config["dtype"] = dtype
        config.pop("torch_dtype", None)
    return config


def written_config(config: dict, plan: Plan, dtype: str) -> dict:
    """The config.json the output folder holds: `new_config`'s, or with `--to mla` the stock DeepseekV3 class's."""
    grouped = new_config(config, plan, dtype)
    return grouped if plan.latent is None else latent_config(grouped, plan.latent, plan.num_layers)

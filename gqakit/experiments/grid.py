"""The GQA paper's uptraining experiment on one MHA model, as one resumable grid.

    python -m gqakit.experiments.grid recipes/gqa_paper.yaml [key=value ...]

For every K/V group count G and merge method (mean, first, random, aligned, or fit, which needs
`calibration`; an encoder-decoder such as the embedded T5 takes mean, first and random, and is scored and
uptrained on T5's span corruption): convert the MHA model, score held-out perplexity at alpha = 0,
uptrain with each alpha (cross-entropy only, as in the paper, and with distillation from the MHA model),
and score again.
Each finished cell is a JSON file under OUTPUT/cells/ named by G, method, alpha and distillation, so an
interrupted grid picks up where it stopped and added methods add cells without touching finished ones;
the table (results.md/.csv/.json) and the plot (gqa_paper.png) are rewritten from all cells at the end.
Cells are reused only under the settings they were made with (OUTPUT/grid.json: every key but those that
pick cells or keep files, and the bytes of the model folder, eval_text, calibration and the uptraining data);
other settings are refused in one line, and `force=true` starts the grid over. Every check runs before the first
file is written: a list no cell reads (alphas when every G is 1 and mha_control is false: MQA takes mqa_alphas), a
value listed twice, a per-cell uptrain key, and an eval_window past the model's context or longer than the text.
Ainslie et al. (2023), Fig. 4-5, expect: mean > first > random before and after uptraining, GQA usable
at alpha = 0 while MQA needs uptraining, and most of the gap recovered by alpha = 0.05.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from gqakit.common.digest import sha256_of
from gqakit.common.atomic import Terminated, replace_text, sigterm_as_interrupt
from gqakit.common.errors import GqakitError
from gqakit.common.overlap import refuse_shared
from gqakit.common.options import SEED_MAX, check_fields, option
from gqakit.common.recipes import from_dict, load_recipe, to_dict
from gqakit.convert import methods
from gqakit.uptrain.config import UptrainConfig, check, pretraining_tokens


@dataclasses.dataclass(frozen=True)
class GridConfig:
    """`recipes/gqa_paper.yaml`: the grid, plus the uptraining recipe every cell shares."""

    model: str  # the MHA source (its folder must record pretraining_tokens for alpha)
    output_dir: str
    uptrain: dict  # UptrainConfig keys shared by every cell (data, seq_len, lr, ...)
    groups: tuple[int, ...] = option((4, 2, 1), above=0)
    methods: tuple[str, ...] = ("mean", "first", "random")  # any of convert-gqa's --method
    alphas: tuple[float, ...] = option((0.05,), above=0)
    mqa_alphas: tuple[float, ...] = option((0.05, 0.10), above=0)  # MQA (G = 1) gets a longer budget too
    distill: tuple[bool, ...] = (False, True)
    eval_text: str = "gqakit/assets/heldout_emma.txt"
    eval_tokens: int = option(16384, at_least=0)  # 0 = the whole text
    eval_window: int = option(512, at_least=2)  # a window's first token has no context: 2 positions score one
    mha_control: bool = True  # also train the MHA model itself for each alpha (a baseline, not in the paper)
    keep_models: bool = False  # keep every converted and uptrained model (about 16 MB each)
    seed: int = option(0, at_least=0, at_most=SEED_MAX)
    calibration: str | None = None  # method fit's calibration text or dataset (convert-gqa --calibration)
    calibration_tokens: int | None = option(None, above=0)  # None = convert-gqa's default
    force: bool = False  # start over: delete OUTPUT's cells and models, made under other settings

    def __post_init__(self):
        check_fields(self)
        for key, setter in PER_CELL.items():
            if key in (self.uptrain or {}):
                raise GqakitError(f"uptrain.{key} is set by the grid for each cell ({setter}), so this one would be "
                                  f"overridden or leak into cells it does not belong to; drop it from uptrain:")
        unknown = [m for m in self.methods if m not in methods.NAMES]
        if unknown:
            raise GqakitError(f"methods={list(self.methods)!r} holds {', '.join(unknown)}, not a convert-gqa method; "
                              f"choose from {', '.join(methods.NAMES)}")
        needing = [m for m in self.methods if m in methods.NEED_CALIBRATION]
        if needing and self.calibration is None:
            raise GqakitError(f"method {needing[0]} needs calibration data: set calibration: TEXT.txt (or a .jsonl / "
                              ".parquet dataset) in the model's language, disjoint from eval_text")
        if self.calibration is not None and not needing:
            need = " or ".join(methods.NEED_CALIBRATION)
            raise GqakitError(f"calibration is used only by method {need}; drop it, or add {need} to methods")
        if self.calibration_tokens is not None and self.calibration is None:
            raise GqakitError("calibration_tokens needs calibration; set calibration, or drop calibration_tokens")
        _refuse_repeated(self)
        _refuse_unread(self)
        if self.eval_tokens and self.eval_tokens < self.eval_window:  # `gqakit eval ppl`'s rule: a whole window
            raise GqakitError(f"eval_tokens={self.eval_tokens} is shorter than one window of eval_window="
                              f"{self.eval_window}; use eval_tokens >= {self.eval_window} (0 = the whole text) or "
                              f"eval_window <= {self.eval_tokens}")


# uptrain keys the grid sets per cell, refused in its shared `uptrain:` section (a teacher there distilled the cells
# reported as not distilled; seed, alpha and model were silently overridden)
PER_CELL = {"model": "the converted model", "output_dir": "the cell's folder", "alpha": "alphas / mqa_alphas",
            "steps": "its budget, alpha: alphas / mqa_alphas", "tokens": "its budget, alpha: alphas / mqa_alphas",
            "seed": "the grid's seed", "teacher": "distill: true cells distil from model",
            "force": "each cell replaces its own folder; force=true at the top starts the grid over"}

# the lists that pick cells: who reads each, the keys that decide whether any cell does, and how to give it one
LISTS = {"groups": ("each G is converted by each of methods", ("methods",), "add a method"),
         "methods": ("each method converts each of groups", ("groups",), "add a group count"),
         "alphas": ("they are the budgets of the G > 1 cells (each trained once per distill value) and of the MHA "
                    "control", ("groups", "methods", "distill", "mha_control"),
                    "add a G > 1 to groups, or set mha_control: true"),
         "mqa_alphas": ("they are the budgets of the G = 1 (MQA) cells (each trained once per distill value) and of "
                        "the MHA control", ("groups", "methods", "distill", "mha_control"),
                        "add 1 to groups, or set mha_control: true"),
         "distill": ("it says how the converted cells that alphas / mqa_alphas uptrain are trained",
                     ("groups", "methods", "alphas", "mqa_alphas"), "give their groups alphas / mqa_alphas")}


def _shown(value) -> str:
    """A value as a recipe or an override spells it: [0.05, 0.1], ["mean"], false."""
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def _refuse_repeated(cfg: GridConfig) -> None:
    """A value listed twice names the same cell twice: it ran once and was reported twice."""
    for key in LISTS:
        seen = set()
        for value in getattr(cfg, key):
            name = f"{value:g}" if key.endswith("alphas") else _shown(value)  # cells are named by alpha to 6 digits
            if name in seen:
                raise GqakitError(f"{key}={_shown(getattr(cfg, key))} lists {name} twice, which names the same "
                                  f"cells; list each value once")
            seen.add(name)


def _readers(cfg: GridConfig) -> dict[str, bool]:
    """Whether any cell reads each of LISTS (as `_cells` makes them)."""
    converted = bool(cfg.methods and cfg.distill)  # cells uptrained from conversions exist for some budget
    return {"groups": bool(cfg.methods), "methods": bool(cfg.groups),
            "alphas": cfg.mha_control or (converted and any(g != 1 for g in cfg.groups)),
            "mqa_alphas": cfg.mha_control or (converted and 1 in cfg.groups),
            "distill": bool(cfg.methods) and any(_budgets(cfg, g) for g in cfg.groups)}


def _refuse_unread(cfg: GridConfig) -> None:
    """A list that no cell reads would be ignored: refused, naming who reads it and what keeps them from it."""
    read = _readers(cfg)
    for key, (readers, deciding, fix) in LISTS.items():
        if getattr(cfg, key) and not read[key]:
            here = ", ".join(f"{k}={_shown(getattr(cfg, k))}" for k in deciding)
            raise GqakitError(f"{key}={_shown(getattr(cfg, key))} is read by no cell: {readers}, and here {here}; "
                              f"set {key}: [] or {fix}")


# keys that pick which cells run or which files stay; every other key changes the numbers of every cell
SELECTION = ("output_dir", "groups", "methods", "alphas", "mqa_alphas", "distill", "mha_control", "keep_models",
             "force")


# what only the methods that calibrate read (fit): it may change while no such cell or model exists
CALIBRATION = ("calibration_tokens", "calibration_file")
# uptrain keys that change no number: progress, threads and tokenising, checkpoint bookkeeping
BOOKKEEPING = ("progress", "threads", "num_proc", "cache_dir", "log_every", "checkpoint_every", "keep_checkpoints",
               "delete_checkpoints", "force")


# uptrain keys that only a distilling cell reads: the others train without them (uptrain refuses them there)
DISTILL_KEYS = ("distill_weight", "distill_temperature", "distill_top_k")


def _shared_recipe(cfg: GridConfig, distil: bool = False) -> UptrainConfig:
    """The uptraining recipe every cell shares, as one cell would run it (a placeholder budget: cells set theirs):
    a distilling cell's (`distil`: the MHA model as teacher), or the others', which leave the distill keys out."""
    return from_dict(UptrainConfig, {**_cell_keys(cfg, distil), "model": cfg.model, "output_dir": cfg.output_dir,
                                     "alpha": 0.05}, source="uptrain")


def _cell_keys(cfg: GridConfig, distil: bool) -> dict:
    """The shared `uptrain:` keys as a cell reads them: with the teacher when it distils, without the distill keys
    when it does not."""
    if distil:
        return {**cfg.uptrain, "teacher": cfg.model}
    return {k: v for k, v in cfg.uptrain.items() if k not in DISTILL_KEYS}


def _settings(cfg: GridConfig) -> dict:
    """What the cells' numbers depend on, as JSON would read it back: the grid's keys less SELECTION, the uptrain
    keys less BOOKKEEPING, and the bytes (not the paths) of the model folder (weights, config, tokenizer,
    pretraining.json; not its README), eval_text, calibration and the uptrain data files."""
    inputs = {"model": cfg.model, "eval_text": cfg.eval_text, "calibration": cfg.calibration}
    settings = {k: v for k, v in to_dict(cfg).items() if k not in (*SELECTION, *inputs)}
    full = to_dict(_shared_recipe(cfg))  # every key, defaults filled in
    uptrain = {k: v for k, v in full.items() if k not in (*BOOKKEEPING, "model", "output_dir", "alpha")}
    uptrain.update({k: cfg.uptrain[k] for k in DISTILL_KEYS if k in cfg.uptrain})  # what distilling cells read
    for key in ("data", "eval_data"):  # local files by their bytes; hub names as given
        uptrain[key] = [sha256_of(Path(d)) if Path(d).exists() else d for d in uptrain.get(key) or ()]
    settings.update(uptrain=uptrain, model_files=sha256_of(Path(cfg.model), skip=("README.md",)),
                    eval_text_file=sha256_of(Path(cfg.eval_text)),
                    calibration_file=sha256_of(Path(cfg.calibration)) if cfg.calibration else None)
    return json.loads(json.dumps(settings))  # tuples read back as lists


# What a grid folder holds: its record, its cells, the models it keeps, its report (and files being replaced)
GRID_ENTRIES = ("grid.json", "cells", "models", "results.md", "results.csv", "results.json", "gqa_paper.png")


def _claim(cfg: GridConfig, out: Path) -> None:
    """Refuse a folder the grid did not make, and to reuse cells (or kept models) made under other settings, whose
    numbers would be reported under these; with force, delete them. Then record these settings in OUTPUT/grid.json."""
    record, cells, models = out / "grid.json", out / "cells", out / "models"
    if out.exists() and not out.is_dir():
        raise GqakitError(f"output_dir {out} is a file; give a folder for the grid")
    # hidden entries are nobody's results (a stopped write's temp, .DS_Store, .ipynb_checkpoints); an empty cells/
    # is what a first run stopped before its record leaves
    entries = sorted(p.name for p in out.iterdir() if not p.name.startswith(".")
                     and not (p.name == "cells" and p.is_dir() and not any(p.iterdir()))) if out.is_dir() else []
    foreign = [name for name in entries if name not in GRID_ENTRIES]
    if foreign or (entries and not record.is_file()):  # force replaces what the grid wrote, nothing else
        what = f"holds {', '.join(foreign[:3])}, which" if foreign else "has no grid.json: what it holds"
        raise GqakitError(f"output_dir {out} {what} the grid did not write; choose a new or empty folder")
    now = _settings(cfg)
    if cfg.force:
        for folder in (cells, models):
            shutil.rmtree(folder, ignore_errors=True)
    elif record.is_file() and any(p.is_dir() and any(p.iterdir()) for p in (cells, models)):
        before = json.loads(record.read_text()).get("settings", {})  # none recorded (an older grid): not compared
        calibrated = any(next(cells.glob(f"*-{m}-*.json"), None) or next(models.glob(f"*/{m}"), None)
                         for m in methods.NEED_CALIBRATION)
        changed = sorted(k for k in now if k in before and before[k] != now[k] and (calibrated or k not in CALIBRATION))
        if changed:
            raise GqakitError(f"{out} holds cells made with other {', '.join(changed)}; their numbers would be "
                              "reported under these settings. Choose another output_dir, or pass force=true to "
                              "start the grid over")
    out.mkdir(parents=True, exist_ok=True)
    # first: it makes the folder ours
    replace_text(record, json.dumps({**to_dict(cfg), "settings": now}, indent=2) + "\n")
    cells.mkdir(exist_ok=True)


def _cells(cfg: GridConfig) -> list[dict]:
    config = json.loads(Path(cfg.model, "config.json").read_text())
    heads = config.get("num_attention_heads") or config["num_heads"]  # T5 spells it num_heads
    cells = [{"groups": heads, "method": "mha", "alpha": 0.0, "distill": False}]
    if cfg.mha_control:  # the MHA model trained on for the same budgets: how much is conversion's gap?
        for alpha in sorted({*cfg.alphas, *cfg.mqa_alphas}):
            cells.append({"groups": heads, "method": "mha", "alpha": alpha, "distill": False})
    for g in cfg.groups:
        for method in cfg.methods:
            cells.append({"groups": g, "method": method, "alpha": 0.0, "distill": False})
            for alpha in _budgets(cfg, g):
                for distill in cfg.distill:
                    cells.append({"groups": g, "method": method, "alpha": alpha, "distill": distill})
    return cells


def _budgets(cfg: GridConfig, groups: int) -> tuple[float, ...]:
    """The alphas that a converted cell of `groups` K/V heads is uptrained for: MQA gets its own list."""
    return cfg.mqa_alphas if groups == 1 else cfg.alphas


def _name(cell: dict) -> str:
    if cell["method"] == "mha":
        return "mha" + (f"-a{cell['alpha']:g}" if cell["alpha"] else "")
    kind = "mqa" if cell["groups"] == 1 else f"gqa{cell['groups']}"
    return f"{kind}-{cell['method']}-a{cell['alpha']:g}" + ("-kd" if cell["distill"] else "")


def _eval_ids(cfg: GridConfig) -> torch.Tensor:
    """The held-out tokens every cell is scored on; a text shorter than one window is refused, as `gqakit eval ppl`
    refuses it (a window cut to the text would be recorded as eval_window)."""
    from transformers import AutoTokenizer

    from gqakit.common.text import encode_documents, load_text_file

    ids = encode_documents(load_text_file(cfg.eval_text), AutoTokenizer.from_pretrained(cfg.model),
                           cfg.eval_tokens or None)
    if ids.numel() < cfg.eval_window:
        raise GqakitError(f"eval_text {cfg.eval_text} has {ids.numel():,} tokens ({Path(cfg.model).name}'s "
                          f"tokenizer), shorter than one window of eval_window={cfg.eval_window}; pass a longer "
                          f"eval_text or eval_window <= {ids.numel()}")
    return ids


def _perplexity(path: Path, ids: torch.Tensor, window: int) -> float:
    """Held-out perplexity: of next tokens (a decoder), or of T5's span-corruption targets (an encoder-decoder,
    the masks seeded by each window, so every cell scores the same corrupted windows)."""
    import math

    from transformers import AutoTokenizer

    from gqakit.evaluate.perplexity import perplexity, span_corruption_nll
    from gqakit.uptrain.modeling import load_lm

    model = load_lm(str(path)).eval()
    if not model.config.is_encoder_decoder:
        return perplexity(model, ids, window, progress=False)
    nll, count = span_corruption_nll(model, ids, window, AutoTokenizer.from_pretrained(path), progress=False)
    return math.exp(nll / count)


def _check(cfg: GridConfig) -> None:
    if not Path(cfg.model, "config.json").is_file():
        raise GqakitError(f"model {cfg.model} is not a Hugging Face checkpoint folder; fix `model`")
    if pretraining_tokens(cfg.model) is None:
        raise GqakitError(f"{cfg.model} records no pretraining_tokens (pretraining.json), so alpha has no meaning; "
                          "use a model that records its pretraining budget")
    _check_window(cfg)
    distils = True in cfg.distill and _readers(cfg)["distill"]
    unread = [key for key in DISTILL_KEYS if key in cfg.uptrain]
    if unread and not distils:
        raise GqakitError(f"uptrain.{unread[0]} is read by distilling cells only (distill: true), and none runs; "
                          f"drop it, or add true to distill")
    shared = _shared_recipe(cfg)
    check(shared)
    if distils:  # the distilling cells' recipe: the MHA model as teacher, the distill keys read
        check(_shared_recipe(cfg, True))
    _check_conversions(cfg)
    if not Path(cfg.eval_text).is_file():
        raise GqakitError(f"eval_text {cfg.eval_text} does not exist; fix the path")
    if cfg.calibration is not None and not Path(cfg.calibration).exists():
        raise GqakitError(f"calibration {cfg.calibration} does not exist; fix the path")
    fitted = [*(("uptrain data", d) for d in shared.data),
              *((("calibration", cfg.calibration),) if cfg.calibration else ())]
    refuse_shared(("eval_text", cfg.eval_text), fitted, "score the grid on a text that no cell is fitted or "
                  "trained on")


def _check_window(cfg: GridConfig) -> None:
    """eval_window against the model's context, by `gqakit eval ppl`'s own check of --max-length: positions the model
    never saw were scored without a word (a review: 2,048 on a 1,024-token model)."""
    from gqakit.common.errors import renamed
    from gqakit.evaluate.perplexity import check_context
    from gqakit.hf.fields import context_length

    with renamed({"max_length": "eval_window"}):
        check_context(cfg.eval_window, context_length(json.loads(Path(cfg.model, "config.json").read_text())))


def _check_conversions(cfg: GridConfig) -> None:
    """Every (groups, method) the grid will convert, planned on the model's headers as convert-gqa plans it (no
    weights read): a grouping the model cannot take is refused before the first cell, not after the MHA control
    cells have trained (a review: `groups=[3]` on 8 heads failed after 5 minutes)."""
    from gqakit.convert.plan import make_plan
    from gqakit.hf.folder import model_folder

    folder = model_folder(cfg.model)
    for groups in cfg.groups:
        for method in cfg.methods:
            try:
                make_plan(folder.config, folder.tensors, groups, method)
            except GqakitError as e:
                raise GqakitError(f"groups={groups}, method={method}: {e}") from None


def run_cell(cfg: GridConfig, cell: dict, work: Path, ids: torch.Tensor, mha_ppl: float | None) -> dict:
    """Convert (alpha 0) or uptrain one cell and score it; returns its result row."""
    from gqakit.convert import ConvertConfig, convert
    from gqakit.convert.options import draws_at_random
    from gqakit.uptrain.loop import uptrain

    t0 = time.perf_counter()
    row = {**cell, "name": _name(cell)}
    if cell["method"] == "mha" and not cell["alpha"]:
        row["perplexity"] = _perplexity(Path(cfg.model), ids, cfg.eval_window)
    else:
        if cell["method"] == "mha":  # the control: the source model itself, trained on
            converted = Path(cfg.model)
        else:
            converted = work / ("mqa" if cell["groups"] == 1 else f"gqa{cell['groups']}") / cell["method"]
        if not (converted / "config.json").is_file():
            # calibration data goes to fit only: aligned would use it too, but the grid keeps aligned weight-only
            calibrated = {}
            if cell["method"] in methods.NEED_CALIBRATION:
                calibrated["calibration"] = cfg.calibration
                if cfg.calibration_tokens is not None:  # else convert-gqa's default
                    calibrated["calibration_tokens"] = cfg.calibration_tokens
            seed = cfg.seed if draws_at_random(cell["method"], calibrated.get("calibration")) else 0  # else refused
            convert(ConvertConfig(model_dir=cfg.model, groups=cell["groups"], output_dir=str(converted),
                                  method=cell["method"], seed=seed, force=True, progress=False, **calibrated))
        target = converted
        if cell["alpha"] > 0:
            target = work / "uptrained" / row["name"]
            recipe = {**_cell_keys(cfg, cell["distill"]), "model": str(converted), "output_dir": str(target),
                      "alpha": cell["alpha"], "force": True, "seed": cfg.seed}
            record = uptrain(from_dict(UptrainConfig, recipe, source="uptrain"), command=f"grid cell {row['name']}")
            row.update(steps=record["budget"]["steps"], tokens=record["budget"]["tokens"],
                       train_seconds=record["train_seconds"])
        row["perplexity"] = _perplexity(target, ids, cfg.eval_window)
        if target != converted and not cfg.keep_models:
            shutil.rmtree(target, ignore_errors=True)
    if mha_ppl:
        row["vs_mha"] = row["perplexity"] / mha_ppl
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def _finished(path: Path) -> dict | None:
    """A finished cell's row, or None: not run yet, or a file a crash left unreadable (run again, with a notice)."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        print(f"[grid] {path} is unreadable (a stopped run's?): running that cell again", flush=True)
        return None


def run_grid(cfg: GridConfig) -> list[dict]:
    from gqakit.common.report import versions
    from gqakit.experiments.grid_report import write_grid_report

    _check(cfg)
    ids = _eval_ids(cfg)  # every check, this one too, before _claim writes the first file
    out = Path(cfg.output_dir)
    cells_dir, work = out / "cells", out / "models"
    _claim(cfg, out)
    rows, mha_ppl = [], None
    for cell in _cells(cfg):
        path = cells_dir / f"{_name(cell)}.json"
        row = _finished(path)
        if row is None:
            print(f"[grid] {_name(cell)} ...", flush=True)
            row = run_cell(cfg, cell, work, ids, mha_ppl)
            row["versions"] = versions()
            replace_text(path, json.dumps(row, indent=2) + "\n")
        print(f"[grid] {row['name']}: perplexity {row['perplexity']:.2f} ({row['seconds']:.0f} s)", flush=True)
        mha_ppl = mha_ppl or row["perplexity"]
        rows.append(row)
    if not cfg.keep_models:
        shutil.rmtree(work, ignore_errors=True)
    write_grid_report(out, rows, cfg, eval_tokens=int(ids.numel()))
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    usage = "usage: python -m gqakit.experiments.grid RECIPE.yaml [key=value ...]"
    if not argv:
        print(usage, file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(f"{usage}\n\nThe GQA paper's grid (recipes/gqa_paper.yaml): every key of the recipe may be overridden "
              "as key=value; see docs/results/gqa-paper.md.")
        return 0
    try:
        with sigterm_as_interrupt():  # SIGTERM stops it as Ctrl-C does
            run_grid(load_recipe(GridConfig, argv[0], argv[1:]))
    except GqakitError as e:
        print(f"gqakit grid: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        terminated = isinstance(e, Terminated)
        print(f"gqakit grid: {'terminated' if terminated else 'interrupted'}; the finished cells are kept: run the "
              "same command again to go on", file=sys.stderr)
        return 143 if terminated else 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

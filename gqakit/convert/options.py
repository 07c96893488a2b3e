"""The options of `convert-gqa` (`gqakit convert`): one frozen dataclass, each field declared once with its flag
(`common.options.option(help=...)`); the command line is built from it. Also the options of attention transfer
(`TransferOptions`) and the checks that refuse an option the chosen method would ignore. No torch here."""
from __future__ import annotations

import dataclasses

from gqakit.common import dtypes
from gqakit.common.errors import GqakitError
from gqakit.common.options import option
from gqakit.convert import methods


# --transfer-params: which projections of the merged attention are trained (the rest stay as merged)
PARAMS = {"kv": ("k_proj", "v_proj"), "qkvo": ("q_proj", "k_proj", "v_proj", "o_proj")}
INPUTS = ("original", "converted")  # --transfer-inputs
STARTS = ("fit", "aligned")  # --transfer-start: calibrated merges (methods.METHODS) training can start from
DTYPES = ("float32", "bfloat16")  # --transfer-dtype


@dataclasses.dataclass(frozen=True)
class ConvertConfig:
    """Options of `convert-gqa`; the CLI flags map onto these fields one to one."""

    model_dir: str = option(flag="MODEL_DIR", help="Hugging Face checkpoint folder (config.json + safetensors)")
    groups: int = option(flag="-g/--groups", help="number of K/V heads after conversion (1 = MQA)")
    output_dir: str | None = option(None, flag="-o/--output-dir",
                                    help="output folder (default: MODEL_DIR-gqaG, or MODEL_DIR-mqa for G=1)")
    method: str = option("mean", choices=methods.NAMES,
                         help="how to merge each group's K/V heads: " + "; ".join(
                             f"{m.name}: {m.help}" for m in methods.METHODS.values()) + "; see docs/convert.md "
                              "(default: mean)")
    dtype: str = option("auto", choices=dtypes.WITH_AUTO,
                        help="dtype of the output weights (default: keep each tensor's dtype)")
    seed: int = option(0, help="seed for --method random and transfer (default: 0)")
    max_shard_size: str = option("5GB", help="largest output shard (default: 5GB)")
    force: bool = option(False, help="replace an existing output folder")
    dry_run: bool = option(False, help="print the plan and write nothing")
    progress: bool = option(True, flag="-q/--quiet", invert=True, help="no progress bar")
    grouping: str | None = option(None, choices=methods.GROUPINGS,
                                  help="aligned/fit: which K/V heads share a group: neighbours, or the most similar "
                                       "heads (q_proj/o_proj permuted to match) (default: similarity)")
    calibration: str | None = option(None, metavar="DATA",
                                     help="aligned/fit: text (.txt) or dataset (.jsonl/.json/.parquet file or folder) "
                                          "whose activations weight the merge, streamed layer by layer (required by "
                                          "fit)")
    calibration_tokens: int | None = option(None, help="calibration tokens to read (default: 16384; 1 in 8 windows "
                                                       "is held out to score the merge)")
    calibration_window: int | None = option(None, help="tokens per calibration window (default: min(512, the "
                                                       "model's context))")
    text_column: str | None = option(None, help="dataset column holding the calibration text (default: text)")
    calibration_device: str | None = option(None, help="device that runs calibration, one layer at a time "
                                                       "(default: cpu; e.g. cuda)")
    pool_encoder: bool = option(False, help="encoder-decoders (T5): group the encoder's self-attention K/V heads "
                                            "too (default: only the decoder's self- and cross-attention, as in the "
                                            "GQA paper)")
    transfer_params: str | None = option(None, choices=tuple(PARAMS),
                                         help="transfer: which merged projections are trained, K/V only or also Q "
                                              "and O (default: qkvo)")
    transfer_steps: int | None = option(None, help="transfer: most training steps per layer, of about 1,024 tokens "
                                                   "each (2 windows of 512); held-out windows stop it earlier "
                                                   "(default: 600)")
    transfer_patience: int | None = option(None, help="transfer: held-out scores (every 20 steps) without "
                                                      "improvement before a layer stops; 0: never stop early, the "
                                                      "best score's weights are kept (default: 3)")
    transfer_inputs: str | None = option(None, choices=INPUTS,
                                         help="transfer: what each layer is trained on: the original model's "
                                              "layer inputs, or those of the model converted up to that layer "
                                              "(the target stays the original's attention output; default: "
                                              "original)")
    transfer_start: str | None = option(None, choices=STARTS,
                                        help="transfer: the calibrated merge that training starts from "
                                             "(default: fit)")
    transfer_dtype: str | None = option(None, choices=DTYPES,
                                        help="transfer: the precision of training's forward and backward (bfloat16: "
                                             "autocast, weights and held-out scores stay float32; about 1.5x faster "
                                             "on CPUs with fast bfloat16; default: float32)")


@dataclasses.dataclass(frozen=True)
class TransferOptions:
    """How each layer is trained (defaults chosen by measurement: docs/convert.md, "Attention transfer")."""

    params: str = "qkvo"
    steps: int = 600  # at most, per layer
    lr: float = 0.05  # relative: each trained tensor's step size is lr x its RMS at the start (scale-free)
    step_tokens: int = 1024  # tokens per step: max(1, step_tokens // window) windows (2 windows of 512)
    warmup: float = 0.1  # fraction of `steps`
    eval_every: int = 20
    patience: int = 3  # held-out scores without improvement before stopping; 0: never stop early
    inputs: str = "original"  # each layer's inputs: the original model's, or the model's converted so far
    start: str = "fit"  # the calibrated merge that training starts from
    dtype: str = "float32"  # training's forward and backward: float32, or bfloat16 autocast
    seed: int = 0

    def __post_init__(self):
        if self.params not in PARAMS:
            raise GqakitError(f"--transfer-params {self.params!r} is not one of {', '.join(PARAMS)}")
        if self.steps < 1:
            raise GqakitError(f"--transfer-steps {self.steps} must be at least 1")
        if self.start not in STARTS:
            raise GqakitError(f"--transfer-start {self.start!r} is not one of {', '.join(STARTS)}")
        if self.inputs not in INPUTS:
            raise GqakitError(f"--transfer-inputs {self.inputs!r} is not one of {', '.join(INPUTS)}")
        if self.dtype not in DTYPES:
            raise GqakitError(f"--transfer-dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.patience < 0:
            raise GqakitError(f"--transfer-patience {self.patience} must be 0 (never stop early) or more")


def transfer_options(cfg: ConvertConfig) -> TransferOptions:
    """The transfer options a `ConvertConfig` asks for, its unset flags at their defaults (checked here)."""
    given = {"params": cfg.transfer_params, "steps": cfg.transfer_steps, "patience": cfg.transfer_patience,
             "inputs": cfg.transfer_inputs, "start": cfg.transfer_start, "dtype": cfg.transfer_dtype}
    for flag, value in (("--transfer-steps", cfg.transfer_steps), ("--transfer-patience", cfg.transfer_patience)):
        if isinstance(value, bool) or not isinstance(value, (int, type(None))):
            raise GqakitError(f"{flag} must be a whole number, got {value!r}")
    return TransferOptions(seed=cfg.seed, **{k: v for k, v in given.items() if v is not None})


def check_options(cfg: ConvertConfig) -> None:
    """Refuse an unknown dtype, options the chosen method would ignore, and a fit without its calibration data."""
    if cfg.dtype not in dtypes.WITH_AUTO:
        raise GqakitError(f"unknown --dtype {cfg.dtype!r}; choose auto, float32, bfloat16 or float16")
    if cfg.grouping is not None and cfg.grouping not in methods.GROUPINGS:
        raise GqakitError(f"unknown --grouping {cfg.grouping!r}; choose contiguous or similarity")
    method = methods.get(cfg.method)
    if cfg.grouping is not None and not method.layerwise:
        raise GqakitError(f"--grouping is used only by --method {' or '.join(methods.LAYERWISE)}; drop it for "
                          f"--method {cfg.method} (which keeps contiguous groups)")
    if method.calibration == "required" and cfg.calibration is None:
        raise GqakitError(f"--method {cfg.method} needs calibration data: pass --calibration TEXT.txt (or a .jsonl / "
                          ".parquet dataset) in the model's language, e.g. a few hundred windows of its training text")
    if cfg.calibration is not None and method.calibration == "no":
        raise GqakitError(f"--calibration is used only by --method {' or '.join(methods.TAKE_CALIBRATION)}; drop it, "
                          f"or choose --method {' or '.join(methods.NEED_CALIBRATION)}")
    if cfg.calibration is None:
        given = [flag for flag, value in (("--calibration-tokens", cfg.calibration_tokens),
                                          ("--calibration-window", cfg.calibration_window),
                                          ("--text-column", cfg.text_column),
                                          ("--calibration-device", cfg.calibration_device)) if value is not None]
        if given:
            raise GqakitError(f"{given[0]} needs --calibration DATA; pass the calibration data or drop {given[0]}")
    for flag, value in (("--calibration-tokens", cfg.calibration_tokens),
                        ("--calibration-window", cfg.calibration_window)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise GqakitError(f"{flag} must be a positive number of tokens, got {value!r}")
    if not method.transfer:
        given = [flag for flag, value in (("--transfer-params", cfg.transfer_params),
                                          ("--transfer-steps", cfg.transfer_steps),
                                          ("--transfer-patience", cfg.transfer_patience),
                                          ("--transfer-inputs", cfg.transfer_inputs),
                                          ("--transfer-start", cfg.transfer_start),
                                          ("--transfer-dtype", cfg.transfer_dtype)) if value is not None]
        if given:
            raise GqakitError(f"{given[0]} is used only by --method {' or '.join(methods.TRANSFER)}; drop it")
    transfer_options(cfg)  # its own checks

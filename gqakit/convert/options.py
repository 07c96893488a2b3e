"""The options of `convert-gqa` (`gqakit convert`): one frozen dataclass, each field declared once with its flag
(`common.options.option(help=...)`); the command line is built from it. Also the options of attention transfer
(`TransferOptions`) and the checks that refuse an option the chosen method would ignore. No torch here."""
from __future__ import annotations

import dataclasses

from gqakit.common import dtypes
from gqakit.common.errors import GqakitError, opt
from gqakit.common.options import SEED_MAX, check_fields, option, options_given
from gqakit.common.precision import auto_dtype
from gqakit.convert import methods


# --transfer-params: which projections of the merged attention are trained (the rest stay as merged)
PARAMS = {"kv": ("k_proj", "v_proj"), "qkvo": ("q_proj", "k_proj", "v_proj", "o_proj")}
INPUTS = ("original", "converted")  # --transfer-inputs
STARTS = ("fit", "aligned")  # --transfer-start: calibrated merges (methods.METHODS) training can start from
DTYPES = ("auto", "float32", "bfloat16")  # --transfer-dtype; auto: bfloat16 where the device has bf16 units
TARGETS = ("gqa", "mla")  # --to: grouped K/V heads, or latent attention (convert/latent)
LATENT_METHODS = ("mean", "fit", "transfer")  # with --kv-rank: the fit from the weights, calibrated, then trained


@dataclasses.dataclass(frozen=True)
class TransferOptions:
    """How each layer is trained (defaults chosen by measurement: docs/convert.md, "Attention transfer"). The fields
    with a `help` are convert-gqa's --transfer-* flags (`ConvertConfig.transfer`)."""

    params: str = option("qkvo", choices=tuple(PARAMS), remember=True,
                         help="transfer: which merged projections are trained, K/V only or also Q and O")
    steps: int = option(600, remember=True,
                        help="transfer: most training steps per layer, of about 1,024 tokens each (2 windows of "
                             "512); with --transfer-patience, held-out windows stop it earlier")
    lr: float = 0.05  # relative: each trained tensor's step size is lr x its RMS at the start (scale-free)
    step_tokens: int = 1024  # tokens per step: max(1, step_tokens // window) windows (2 windows of 512)
    warmup: float = 0.1  # fraction of `steps`
    eval_every: int = 20
    patience: int = option(0, remember=True,
                           help="transfer: held-out scores (every 20 steps) without improvement before a layer "
                                "stops; 0: never stop early, the best score's weights are kept")
    inputs: str = option("original", choices=INPUTS, remember=True,
                         help="transfer: what each layer is trained on: the original model's layer inputs, or those "
                              "of the model converted up to that layer (the target stays the original's attention "
                              "output)")
    start: str = option("aligned", choices=STARTS, remember=True,
                        help="transfer: the calibrated merge that training starts from")
    dtype: str = option("auto", choices=DTYPES, remember=True,
                        help="transfer: the precision of training's forward and backward (bfloat16: autocast, "
                             "weights and held-out scores stay float32; about 1.35x faster where the device has "
                             "bf16 units; auto: bfloat16 there, else float32)")
    seed: int = 0

    def __post_init__(self):
        if self.params not in PARAMS:
            raise GqakitError(f"{opt('params', repr(self.params))} is not one of {', '.join(PARAMS)}")
        for name in ("steps", "patience"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise GqakitError(f"{opt(name)} must be a whole number, got {value!r}")
        if self.steps < 1:
            raise GqakitError(f"{opt('steps', self.steps)} must be at least 1")
        if self.start not in STARTS:
            raise GqakitError(f"{opt('start', repr(self.start))} is not one of {', '.join(STARTS)}")
        if self.inputs not in INPUTS:
            raise GqakitError(f"{opt('inputs', repr(self.inputs))} is not one of {', '.join(INPUTS)}")
        if self.dtype not in DTYPES:
            raise GqakitError(f"{opt('dtype', repr(self.dtype))} is not one of {', '.join(DTYPES)}")
        if self.patience < 0:
            raise GqakitError(f"{opt('patience', self.patience)} must be 0 (never stop early) or more")
        before_last = (self.steps - 1) // self.eval_every  # held-out scores that a stop could follow
        if self.patience > before_last:
            raise GqakitError(f"{opt('patience', self.patience)} stops a layer after {self.patience} held-out scores "
                              f"without improvement, and {opt('steps', self.steps)} scores {before_last} time(s) "
                              f"before its last step (every {self.eval_every} steps), so it could never stop one; "
                              f"lower {opt('patience')} or raise {opt('steps')}")


@dataclasses.dataclass(frozen=True)
class ConvertConfig:
    """Options of `convert-gqa`; the CLI flags map onto these fields one to one (`transfer`'s as --transfer-*)."""

    model_dir: str = option(flag="MODEL_DIR", help="Hugging Face checkpoint folder (config.json + safetensors)")
    groups: int = option(flag="-g/--groups", help="number of K/V heads after conversion (1 = MQA)")
    output_dir: str | None = option(None, flag="-o/--output-dir", help="output folder",
                                    default_text="MODEL_DIR-gqaG, MODEL_DIR-mqa for G=1, MODEL_DIR-mla for --to mla")
    method: str = option("mean", choices=methods.NAMES,
                         help="how to merge each group's K/V heads: " + "; ".join(
                             f"{m.name}: {m.help}" for m in methods.METHODS.values()) + "; see docs/convert.md")
    dtype: str = option("auto", choices=dtypes.WITH_AUTO, default_text="keep each tensor's dtype",
                        help="dtype of the output weights")
    seed: int = option(0, at_least=-SEED_MAX, at_most=SEED_MAX,
                       help="seed for --method random, transfer, and the model's own calibration samples")
    max_shard_size: str = option("5GB", help="largest output shard")
    force: bool = option(False, help="replace an existing output folder")
    dry_run: bool = option(False, help="print the plan and write nothing")
    progress: bool = option(True, flag="-q/--quiet", invert=True, help="no progress bar")
    grouping: str | None = option(None, choices=methods.GROUPINGS, default_text="similarity",
                                  help="aligned/fit/transfer: which K/V heads share a group: neighbours, or the most "
                                       "similar heads (q_proj/o_proj permuted to match)")
    calibration: str | None = option(None, metavar="DATA",
                                     help="aligned/fit/transfer: text (.txt) or dataset (.jsonl/.json/.parquet file or "
                                          "folder) whose activations weight the merge, streamed layer by layer; fit "
                                          "and transfer without it calibrate on text sampled from the model itself")
    calibration_tokens: int | None = option(None, default_text="16,384; 65,536 for transfer",
                                            help="calibration tokens to read, or to sample (1 in 8 windows is held "
                                                 "out to score the merge)")
    calibration_window: int | None = option(None, default_text="min(512, the model's context)",
                                            help="tokens per calibration window")
    text_column: str = option("text", remember=True, help="dataset column holding the calibration text")
    calibration_device: str = option("cpu", remember=True,
                                     help="device that runs calibration, one layer at a time, and the sampling "
                                          "of data-free calibration (e.g. cuda)")
    to: str = option("gqa", choices=TARGETS,
                     help="what the output's attention is: gqa, grouped K/V heads in the family's own class; mla, "
                          "latent attention in transformers' stock DeepseekV3 class (with --groups 1: the MQA it "
                          "computes exactly, one latent and one shared RoPE key per token; Llama-like models)")
    kv_rank: int | None = option(None, default_text="none: the MQA held exactly",
                                 help="--to mla: fit a latent of this rank (plus one bias value unless --bias-free) "
                                      "to the source's K/V heads: from the weights alone, calibrated with --method "
                                      "fit, then trained with --method transfer; the cache holds kv_rank + 1 + "
                                      "rope_dim values per token and layer (default with --rope-dim D: "
                                      "2 x head_dim - D)")
    rope_dim: int | None = option(None, default_text="head_dim with --kv-rank",
                                  help="--to mla: dims of the one RoPE key shared by every head (the highest "
                                       "frequencies); the rest of each head's key is read from the latent without "
                                       "rotation")
    bias_free: bool = option(False, help="--to mla with --method transfer: no biases, as vLLM and SGLang build "
                                         "DeepSeek's projections (servable there); the latent's RMSNorm is then part "
                                         "of the function, and each layer is trained with it in the loop")
    pool_encoder: bool = option(False, help="encoder-decoders (T5): group the encoder's self-attention K/V heads "
                                            "too (default: only the decoder's self- and cross-attention, as in the "
                                            "GQA paper)")
    transfer: TransferOptions = option(default_factory=TransferOptions, prefix="transfer")
    given: frozenset = frozenset()  # options typed on the command line, even at their default values

    def __post_init__(self):
        check_fields(self)  # the declared bounds (--seed)


def transfer_options(cfg: ConvertConfig) -> TransferOptions:
    """The transfer options a `ConvertConfig` asks for, seeded by its --seed, `auto` dtype resolved for its device."""
    return dataclasses.replace(cfg.transfer, seed=cfg.seed, dtype=auto_dtype(cfg.transfer.dtype,
                                                                              cfg.calibration_device))


def calibration_tokens(cfg: ConvertConfig) -> int:
    """--calibration-tokens, or the method's default (`methods.Method.calibration_tokens`)."""
    return cfg.calibration_tokens if cfg.calibration_tokens is not None else methods.get(cfg.method).calibration_tokens


CALIBRATION_OPTIONS = ("calibration_tokens", "calibration_window", "text_column", "calibration_device")


def draws_at_random(method: str, calibration: str | None) -> bool:
    """Whether a conversion by `method` uses --seed: re-initialised heads, attention transfer's training, or the
    model's own samples that stand in for missing calibration data."""
    chosen = methods.get(method)
    return chosen.seeded or (chosen.calibration == "required" and calibration is None)


def check_options(cfg: ConvertConfig) -> None:
    """Refuse an unknown dtype, options the chosen method would ignore, and a fit without its calibration data."""
    if cfg.to not in TARGETS:
        raise GqakitError(f"unknown {opt('to', repr(cfg.to))}; choose {' or '.join(TARGETS)}")
    latent = [name for name in ("kv_rank", "rope_dim") if getattr(cfg, name) is not None]
    if latent and cfg.to != "mla":
        raise GqakitError(f"{opt(latent[0])} shapes latent attention; add {opt('to', 'mla')} or drop it")
    if latent and cfg.method not in LATENT_METHODS:
        raise GqakitError(f"{opt(latent[0])} fits the latent to the source's K/V heads, merging none: from the "
                          f"weights alone (the default {opt('method', 'mean')}), calibrated "
                          f"({opt('method', 'fit')}) or then trained ({opt('method', 'transfer')}); drop "
                          f"{opt('method', cfg.method)}")
    if latent and "transfer.start" in options_given(cfg, cfg.given):
        raise GqakitError(f"{opt(latent[0])} trains from the latent fitted to the weights, not from a merge; drop "
                          f"{opt('transfer.start')}")
    if cfg.bias_free and cfg.to != "mla":
        raise GqakitError(f"{opt('bias_free')} shapes latent attention; add {opt('to', 'mla')} or drop it")
    if cfg.bias_free and not methods.get(cfg.method).transfer:
        raise GqakitError(f"{opt('bias_free')} leaves the latent's RMSNorm in the function, which only training "
                          f"fits; add {opt('method', 'transfer')}, or drop {opt('bias_free')} (transformers-only)")
    if cfg.dtype not in dtypes.WITH_AUTO:
        raise GqakitError(f"unknown {opt('dtype', repr(cfg.dtype))}; choose auto, float32, bfloat16 or float16")
    if cfg.grouping is not None and cfg.grouping not in methods.GROUPINGS:
        raise GqakitError(f"unknown {opt('grouping', repr(cfg.grouping))}; choose contiguous or similarity")
    method, given = methods.get(cfg.method), options_given(cfg, cfg.given)
    choose = lambda names: " or ".join(names)  # noqa: E731
    if latent and cfg.grouping is not None:
        raise GqakitError(f"{opt('grouping')} picks which heads merge, and the latent fit ({opt(latent[0])}) merges "
                          f"none; drop {opt('grouping')}")
    if "seed" in given and not draws_at_random(cfg.method, cfg.calibration):
        raise GqakitError(f"{opt('seed')} seeds {opt('method', 'random')}, {opt('method', 'transfer')} and the "
                          f"model's own calibration samples; {opt('method', cfg.method)}"
                          f"{' with ' + opt('calibration') if cfg.calibration else ''} draws nothing at random: drop "
                          f"{opt('seed')}")
    if cfg.grouping is not None and not method.layerwise:
        raise GqakitError(f"{opt('grouping')} is used only by {opt('method', choose(methods.LAYERWISE))}; drop it "
                          f"for {opt('method', cfg.method)} (which keeps contiguous groups)")
    if cfg.calibration is not None and method.calibration == "no":
        raise GqakitError(f"{opt('calibration')} is used only by {opt('method', choose(methods.TAKE_CALIBRATION))}; "
                          f"drop it, or choose {opt('method', choose(methods.NEED_CALIBRATION))}")
    if cfg.calibration is None:  # a method that needs calibration samples it: its size and device still apply
        ignored = [name for name in CALIBRATION_OPTIONS if name in given
                   and (method.calibration != "required" or name == "text_column")]
        if ignored:
            raise GqakitError(f"{opt(ignored[0])} needs {opt('calibration', 'DATA')}; pass the calibration data or "
                              f"drop {opt(ignored[0])}")
    if "text_column" in given and cfg.calibration is not None and str(cfg.calibration).lower().endswith(".txt"):
        raise GqakitError(f"{opt('text_column')} names a column of .jsonl / .json / .parquet calibration data, and "
                          f"{opt('calibration', cfg.calibration)} is a text file; drop {opt('text_column')}")
    for name in ("calibration_tokens", "calibration_window"):
        value = getattr(cfg, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise GqakitError(f"{opt(name)} must be a positive number of tokens, got {value!r}")
    ignored = [name for name in given if name.startswith("transfer.")]
    if not method.transfer and ignored:
        raise GqakitError(f"{opt(ignored[0])} is used only by {opt('method', choose(methods.TRANSFER))}; drop it")

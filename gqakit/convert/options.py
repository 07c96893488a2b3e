"""The options of `convert-gqa` (`gqakit convert`): one frozen dataclass, each field declared once with its flag
(`common.options.option(help=...)`); the command line is built from it. No torch here."""
from __future__ import annotations

import dataclasses

from gqakit.common import dtypes
from gqakit.common.options import option
from gqakit.convert import methods


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
    transfer_params: str | None = option(None, choices=("kv", "qkvo"),
                                         help="transfer: which merged projections are trained, K/V only or also Q "
                                              "and O (default: qkvo)")
    transfer_steps: int | None = option(None, help="transfer: most training steps per layer, of about 1,024 tokens "
                                                   "each (2 windows of 512); held-out windows stop it earlier "
                                                   "(default: 600)")
    transfer_patience: int | None = option(None, help="transfer: held-out scores (every 20 steps) without "
                                                      "improvement before a layer stops; 0: never stop early, the "
                                                      "best score's weights are kept (default: 3)")
    transfer_inputs: str | None = option(None, choices=("original", "converted"),
                                         help="transfer: what each layer is trained on: the original model's "
                                              "layer inputs, or those of the model converted up to that layer "
                                              "(the target stays the original's attention output; default: "
                                              "original)")
    transfer_start: str | None = option(None, choices=("fit", "aligned"),
                                        help="transfer: the calibrated merge that training starts from "
                                             "(default: fit)")
    transfer_dtype: str | None = option(None, choices=("float32", "bfloat16"),
                                        help="transfer: the precision of training's forward and backward (bfloat16: "
                                             "autocast, weights and held-out scores stay float32; about 1.5x faster "
                                             "on CPUs with fast bfloat16; default: float32)")

"""The merge methods of `convert-gqa --method`: ONE table, read by the command line, the plan, the run, the model
card, the demo and the GQA-paper grid. Pure data (no torch), so the command line parses without loading torch.

Two families of method:
- head-wise (`pooling`): each K/V head of a group is a block of rows of k_proj / v_proj (and their biases and
  key norms); the group's block becomes one by `methods.pooling` (mean, first) or is re-initialised (random).
  Nothing else in the layer changes.
- layer-wise (`merge`): a layer's q/k/v/o are merged together by `methods.align.align_and_merge_layer` with the
  options in `merge` (exact reparametrisations that rotate each head into a common frame, then a mean or a
  least-squares fit), optionally in a metric measured on calibration text; q_proj and o_proj change too. A
  `transfer` method then trains the merged layer against the original attention (`methods.transfer`).

Adding a method: docs/architecture.md ("Add a merge method").
"""
from __future__ import annotations

import dataclasses

from gqakit.common.errors import GqakitError


@dataclasses.dataclass(frozen=True)
class Method:
    """What a merge method is, needs and does."""

    name: str
    help: str  # one clause for --help
    pooling: str | None = None  # head-wise: "mean" | "first" | "random" (methods.pooling)
    merge: dict | None = None  # layer-wise: the options of align.align_and_merge_layer
    calibration: str = "no"  # "no" | "optional" | "required" (without --calibration DATA: the model's own samples)
    card_note: str | None = None  # what the model card says the merge did (layer-wise methods)
    transfer: bool = False  # then trained per layer to reproduce the original attention (methods.transfer)
    calibration_tokens: int = 16_384  # --calibration-tokens' default: tokens read (or sampled) to calibrate

    @property
    def layerwise(self) -> bool:
        """Rewrites a layer's q/k/v/o together (takes --grouping; scored by each query head's maps)."""
        return self.merge is not None

    @property
    def reinitialises(self) -> bool:
        """Draws new K/V heads instead of merging the old ones (seeded by --seed)."""
        return self.pooling == "random"

    @property
    def norm_pooling(self) -> str:
        """How the per-head weights of a key norm are merged (`pooling.regroup`): a norm is pooled, never drawn anew."""
        return "first" if self.pooling == "first" else "mean"

    @property
    def seeded(self) -> bool:
        """Uses --seed (the card records it)."""
        return self.reinitialises or self.transfer


METHODS = {m.name: m for m in (
    Method("mean", "the GQA paper's mean-pooling of each group's K/V heads", pooling="mean"),
    Method("first", "keep each group's first K/V head", pooling="first"),
    Method("random", "re-initialise K/V with the model's initializer_range, seeded by --seed", pooling="random"),
    Method("aligned", "rotate heads into a common frame first, exactly, then average",
           merge={"align": True, "key_scale": "none", "reference": "mean", "merge": "mean", "restore": "refit"},
           calibration="optional",
           card_note="each group's heads rotated into a common frame (per-RoPE-pair rotations of keys, orthogonal "
                     "maps of values, exact reparametrisations), averaged, then each head's map refitted by least "
                     "squares"),
    Method("fit", "least squares on calibration activations (--calibration TEXT, or the model's own samples)",
           merge={"align": True, "merge": "pca", "restore": "refit"},
           calibration="required",
           card_note="the shared K/V head that minimises each head's attention-logit and value error on calibration "
                     "activations (closed-form least squares per RoPE pair and value subspace), each head's map "
                     "refitted"),
    Method("transfer", "the calibrated aligned merge (or fit's: --transfer-start), then each layer's merged "
                       "attention trained to reproduce the original's output (attention transfer), calibrated as fit "
                       "is",
           merge={"align": True, "merge": "pca", "restore": "refit"},
           calibration="required", transfer=True, calibration_tokens=65_536,
           card_note="a calibrated merge (fit, least squares on calibration activations, unless the transfer row "
                     "says aligned), then each layer's merged projections trained to reproduce the original "
                     "attention's output on the calibration windows (attention transfer; best held-out score kept)"),
)}
NAMES = tuple(METHODS)
# --grouping of the layer-wise methods: which K/V heads share a group (methods.align)
GROUPINGS = ("contiguous", "similarity")
HEADWISE = tuple(name for name, m in METHODS.items() if not m.layerwise)
LAYERWISE = tuple(name for name, m in METHODS.items() if m.layerwise)
TAKE_CALIBRATION = tuple(name for name, m in METHODS.items() if m.calibration != "no")
NEED_CALIBRATION = tuple(name for name, m in METHODS.items() if m.calibration == "required")
TRANSFER = tuple(name for name, m in METHODS.items() if m.transfer)


def get(name: str, flag: str = "--method") -> Method:
    """The method called `name`, or a one-line error listing the choices."""
    if name not in METHODS:
        raise GqakitError(f"unknown {flag} {name!r}; choose one of {', '.join(NAMES)}")
    return METHODS[name]

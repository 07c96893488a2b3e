"""Human-readable descriptions of a conversion: the `--dry-run` plan and the output's model card."""
from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

from gqakit import __version__
from gqakit.hf.architectures.latent import ARCHITECTURE, KV_NORM, LATENT_PARAMS
from gqakit.hf.folder import card_licence
from gqakit.hf.headers import ITEMSIZES
from gqakit.convert import methods
from gqakit.convert.plan import Plan, total_bytes
from gqakit.convert.layer_share import launched_share
from gqakit.convert.output import named
from gqakit.convert.options import PARAMS, transfer_options


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _change(before: int, after: int) -> str:
    if before == after:
        return "unchanged"
    return f"{before / after:.2f}x smaller" if after < before else f"{after / before:.2f}x larger"


def kv_change(plan: Plan) -> str:
    """Bytes per token before -> after, and the ratio; where --dtype changes the width of a value, the ratio at one
    dtype too (bf16 -> float32 MQA of 8 heads is 4x as stored but 8x fewer values: the first alone misled)."""
    before, after = plan.kv_cache_bytes_per_token(False), plan.kv_cache_bytes_per_token(True)
    was, now = plan.source_kv_itemsize, plan.target_kv_itemsize
    if was == now:
        return f"{before:,} -> {after:,} bytes ({_change(before, after)})"
    return (f"{before:,} -> {after:,} bytes ({_change(before, after)} as stored; {_change(before, after * was // now)}"
            f" at one dtype: the output stores {now}-byte values, the source {was}-byte)")


def kv_summary(plan: Plan) -> str:
    return f"KV cache per token at the stored dtype: {kv_change(plan)}{_slides(plan)}"


def _slides(plan: Plan) -> str:
    """Where layers slide, the per-token figure holds up to their window: past it they cache no more tokens."""
    w = plan.sliding_window
    return f"; sliding-window layers cache at most {w:,} tokens each" if w else ""


def describe_plan(plan: Plan) -> str:
    """What `--dry-run` prints: what is regrouped, the shapes, the shards and the KV-cache saving."""
    kinds = Counter(op.kind for op in plan.ops)
    lines = [
        f"{plan.architecture} ({plan.spec.family}): {plan.num_layers} layers, {plan.num_attention_heads} "
        f"attention heads, head_dim {plan.head_dim}",
        f"K/V heads: {plan.num_key_value_heads} -> {plan.groups} ({plan.mode}, method {plan.method})" if not
        plan.latent_fit else f"K/V heads: {plan.num_key_value_heads} -> a fitted latent (no merge method)",
        *([encoder_line(plan)] if plan.spec.encoder_kv else []),
        *([latent_line(plan)] if plan.latent else []),
        *([f"re-hosted: {plan.rehosted.describe()}"] if plan.rehosted else []),
        kv_summary(plan),
        f"tensors: {len(plan.ops)} ({kinds.get('copy', 0)} copied, {kinds.get('cast', 0)} cast, "
        f"{len(plan.ops) - kinds.get('copy', 0) - kinds.get('cast', 0)} regrouped)",
    ]
    shown = [op for op in plan.ops if op.kind not in ("copy", "cast")][:8]
    for op in shown:
        lines.append(f"  {op.name}: {op.kind} -> {op.dtype} {list(op.shape)}")
    regrouped = sum(op.kind not in ("copy", "cast") for op in plan.ops)
    if regrouped > len(shown):
        lines.append(f"  ... and {regrouped - len(shown)} more")
    sizes = [sum(math.prod(plan.ops[i].shape) * ITEMSIZES[plan.ops[i].dtype] for i in s) for s in plan.shards]
    lines.append(f"output: {_gb(total_bytes(plan))} in {len(sizes)} shard(s), at most {_gb(plan.max_shard_bytes)} each")
    for name, size in zip(plan.shard_files, sizes):
        lines.append(f"  {name}: {_gb(size)}")
    if not plan.exact:
        lines.append("note: " + exactness_note(plan))
    if plan.spec.runtime_note:
        lines.append("note: " + plan.spec.runtime_note)
    if plan.own_class:
        lines.append("note: " + own_class_note(plan))
    return "\n".join(lines)


def latent_line(plan: Plan) -> str:
    """--to mla: what the output's attention is and where it runs."""
    shape = plan.latent
    trained = ", then trained per layer by attention transfer" if plan.latent_trained else ""
    held = (f"fitted to the {plan.num_key_value_heads} K/V heads {fitted_how(plan)} (--kv-rank {shape.rank} "
            f"--rope-dim {shape.rope_dim}: the highest {shape.rope_dim // 2} RoPE frequencies shared, {shape.nope_dim} "
            f"dims per head read from the latent without rotation){trained}" if plan.latent_fit
            else "the MQA's value and key, exactly" if shape.bias
            else f"the MQA's value and key, the latent's RMSNorm in the function{trained}")
    servable = ("kv_a_proj_with_mqa carries a bias, so the checkpoint runs in transformers but not in vLLM/SGLang's "
                "DeepSeek classes (which build that projection without one)" if shape.bias else
                "bias-free (attention_bias false), as vLLM and SGLang's DeepSeek classes build it")
    return (f"latent attention (--to mla): transformers' stock {ARCHITECTURE}, caching per token and layer a latent "
            f"of {shape.latent} values and a shared RoPE key of {shape.rope_dim} ({held}); {servable}")


def encoder_line(plan: Plan) -> str:
    if plan.encoder_layers is None:
        return "encoder: self-attention K/V heads kept (pass --pool-encoder to group them too)"
    return f"encoder: {plan.encoder_layers} layers' self-attention K/V heads grouped too (--pool-encoder)"


def own_class_note(plan: Plan) -> str:
    return (f"the output is gqakit's own {plan.own_class[1]} (model_type {plan.own_class[0]}): run `import gqakit` "
            "before loading it with transformers' Auto classes (no remote code, nothing else needed)")


def exactness_note(plan: Plan) -> str:
    then = ("each layer was then trained by attention transfer; measure it with gqakit eval ppl." if
            plan.latent_trained else "measure it with gqakit eval ppl, and train it (gqakit uptrain) before use.")
    if plan.latent_fit:
        return ("the latent is a fit, not the same function: the shared RoPE key keeps each frequency's principal "
                "part across the K/V heads, the other dims are read without rotation, and the latent is a rank "
                f"{plan.latent.rank} approximation of the heads' position-free keys and values; {then}")
    if plan.latent is not None and not plan.latent.bias:
        return ("bias-free, the latent's RMSNorm divides each token's latent by its own RMS, which no weight undoes, "
                f"so this is not the MQA's function; {then}")
    if methods.get(plan.method).reinitialises:
        return "K/V projections are re-initialised at random: the model needs uptraining before use."
    return ("this family normalises keys after the projection (per head, or across heads for OLMo2), so a pooled "
            "head computes the norm of the mean key rather than the mean of the normalised keys: pooling is "
            "exact only for identical heads.")


def _turned_note(plan: Plan) -> str:
    """What the k_proj column at one position leaves out when the latent reads dims without rotation."""
    if not plan.rope_frequencies or not plan.context:
        return ""
    return f"""

The k_proj column compares keys at one position. The latent reads {plan.head_dim - plan.latent.rope_dim} of each
head's {plan.head_dim} key dims without rotation, while the source turns them by each relative position: the next
column is the keys' error as the queries read it, root-mean-square over relative positions 0 to {plan.context - 1:,}
(the context, max_position_embeddings), uniformly weighted."""


def _method_name(plan: Plan) -> str:
    """The card's method row: a latent fitted from the weights alone merges nothing (its plan says "mean")."""
    if plan.latent_fit and plan.method == "mean":
        return "none: the latent is fitted to the K/V heads from the weights alone (--kv-rank / --rope-dim)"
    return plan.method


def _error_heading(plan: Plan, calibrated: bool, trained: bool = False) -> str:
    if plan.latent_fit:
        return f"""## Relative error of the keys and values the fitted latent holds

||W - W'||_F / ||W||_F per layer over the {plan.num_key_value_heads} K/V heads' keys (the shared RoPE key's part as
each head reads it, the rest from the latent) and values (from the latent), of the weights themselves (the latent was
fitted {fitted_how(plan)}){", before training" if trained else ""}.{_turned_note(plan)}"""
    if methods.get(plan.method).layerwise:
        logits = """ The held-out column is the relative error of every query head's attention logits
(q.k after RoPE, before scaling) on the held-out calibration windows, which the statistics never saw:
sqrt(sum ||S' - S||^2 / sum ||S||^2) over the positions each query may attend to.""" if calibrated else ""
        return f"""## Relative error of each query head's attention maps

This merge also rewrites q_proj and o_proj, so it is measured on what each query head j computes:
sqrt(sum_j ||Q_j^T K_h - Q'_j^T K'_g||^2 / sum_j ||Q_j^T K_h||^2) for keys (the logit map at equal
positions, weights only, biases aside) and the same for values with O_j V_h (0: the merge is exact).{logits}"""
    return """## Relative error of the regrouped K/V projections

||W - expand(W')||_F / ||W||_F per layer, where expand repeats each new head over the heads it replaced
(0 means the group's heads were identical or nothing was pooled)."""


_TRANSFER_NOTE = """
The k_proj and v_proj columns (and the logits', where shown) measure {start}, where training started. The last three
columns are the relative error of the layer's attention output (o_proj included) against the original's on
the held-out calibration windows, sqrt(sum ||y' - y||^2 / sum ||y||^2), before and after training, and the
training steps taken (the same windows stop training early, and the best-scoring weights are kept).
"""


def fitted_how(plan: Plan) -> str:
    """How a fitted latent (--kv-rank / --rope-dim) weighed its errors."""
    return ("from the weights alone" if plan.method == "mean" else
            "in the metric of the layer's attention inputs on the calibration text")


def transfer_start(cfg, plan: Plan) -> str:
    """What attention transfer trained from, as the card names it."""
    if plan.latent_fit:
        return f"the latent fitted {fitted_how(plan)} (--kv-rank / --rope-dim)"
    start = f"the calibrated `{transfer_options(cfg).start}` merge"
    return start + (" (held as latent attention without biases)" if plan.latent_trained else "")


def _method_rows(cfg, plan: Plan, calibration) -> str:
    method = methods.get(plan.method)
    if not method.layerwise:
        return ""
    rows = [f"| merge | {method.card_note} |",
            f"| grouping | {cfg.grouping or 'similarity'} (K/V heads that share a group; q_proj rows and "
            "o_proj columns permuted with them, so contiguous `repeat_kv` holds) |"] if not plan.latent_fit else []
    if method.transfer:
        opts = transfer_options(cfg)
        stop = (f"stopped after {opts.patience} held-out scores without improvement" if opts.patience
                else "never stopped early")
        inputs = ("the inputs of the model converted so far (the targets: the original's attention outputs on its "
                  "own inputs)" if opts.inputs == "converted" else "the original model's layer inputs")
        world = launched_share().world
        split = f"; layers split over {world} processes (torchrun)" if world > 1 else ""
        params = LATENT_PARAMS[opts.params] if plan.latent_trained else PARAMS[opts.params]
        params = (*params, *((KV_NORM,) if plan.latent_trained and not plan.latent.bias else ()))
        tensors = ", ".join(p.split(".")[0] for p in params)
        rows.append(f"| transfer | from {transfer_start(cfg, plan)}, trained {tensors} "
                    f"on {inputs}; at most {opts.steps} steps per layer of about {opts.step_tokens:,} tokens, "
                    f"{opts.dtype}{' autocast' if opts.dtype != 'float32' else ''}, {stop}; the best held-out score's "
                    f"weights kept{split} |")
    if calibration is None:
        rows.append("| calibration | none (weights only) |")
    else:
        fit = calibration.windows.shape[0] - calibration.heldout
        rows += [f"| calibration data | `{calibration.path}` (sha256 {calibration.file_sha256}) |" if calibration.path
                 else f"| calibration data | the model's own samples: each window a new document drawn at temperature "
                      f"{calibration.sampled['temperature']:g}, top-p {calibration.sampled['top_p']:g}, seed "
                      f"{calibration.sampled['seed']}, {calibration.sampled.get('dtype', 'float32')} (data-free; "
                      "`gqakit sample`'s sampler) |",
                 f"| calibration tokens | {calibration.tokens:,}: {fit} windows of {calibration.window} fitted, "
                 f"{calibration.heldout} held out (token ids sha256 {calibration.sha256}) |"]
    return "\n".join(rows) + "\n"


def worse_than_mean(errors: dict[int, dict[str, float]]) -> list[int]:
    """The layers whose merge has a larger held-out logit error than mean-pooling would have had."""
    return [layer for layer, e in sorted(errors.items())
            if "logits_mean" in e and e.get("logits", 0.0) > e["logits_mean"]]


def against_mean(plan: Plan, errors: dict[int, dict[str, float]], calibrated: bool) -> str | None:
    """One line when a layer-wise merge is not known to beat mean-pooling on held-out text (None when it does, and
    for a fitted latent, which merges no heads)."""
    if not methods.get(plan.method).layerwise or plan.latent_fit:
        return None
    if not calibrated:
        return (f"--method {plan.method} without --calibration is not checked against mean-pooling on held-out text, "
                "and on some models it is far worse than the mean; pass --calibration TEXT to measure it")
    worse = worse_than_mean(errors)
    if not worse:
        return None
    shown = ", ".join(map(str, worse[:12])) + (" ..." if len(worse) > 12 else "")
    return (f"in {len(worse)} of {len(errors)} layers ({shown}) --method {plan.method} has a larger held-out logit "
            "error than mean-pooling would have; compare the two with gqakit eval ppl before shipping")


def _against_mean(plan: Plan, errors: dict[int, dict[str, float]], calibrated: bool) -> str:
    line = against_mean(plan, errors, calibrated)
    return "" if line is None else f"\n**Warning:** {line}.\n"


def write_card(path: Path, cfg, plan: Plan, errors: dict[int, dict[str, float]], command: str,
               calibration=None) -> None:
    name = ("MLA (a fitted latent)" if plan.latent_fit else "MLA (from MQA)" if plan.latent
            else "MQA" if plan.groups == 1 else f"GQA-{plan.groups}")
    held = calibration is not None and any("logits" in e for e in errors.values())  # a fitted latent has none
    compared = held and any("logits_mean" in e for e in errors.values())
    trained = any("transfer_before" in e for e in errors.values())
    turned = any("k_positions" in e for e in errors.values())  # a fitted latent that reads some dims unrotated
    start = transfer_start(cfg, plan) if trained else ""
    # other K/V sites of a layer (T5: "cross k", "encoder v", ...), in the table's order
    sites = [f"{site} {role}" for site, *_ in (*plan.spec.kv_sites, ("encoder",)) for role in "kv"
             if any(f"{site} {role}" in e for e in errors.values())]
    encoder_row = f"| encoder | {encoder_line(plan).partition(': ')[2]} |\n" if plan.spec.encoder_kv else ""
    attention_row = f"| attention | {latent_line(plan).partition(': ')[2]} |\n" if plan.latent else ""
    seed = f" (seed {cfg.seed})" if methods.get(plan.method).seeded else ""
    reads = ("Every query head reads the shared latent and RoPE key." if plan.latent else
             f"Query head h uses K/V head h // {plan.num_attention_heads // plan.groups} (contiguous groups, "
             "as `repeat_kv` expects).")
    bytes_label = "KV-cache bytes per token (at the stored dtype of k_proj; `gqakit eval` counts its compute dtype)"
    rows = "\n".join(
        f"| {layer} | {e.get('k', float('nan')):.4f} |"
        + (f" {e.get('k_positions', float('nan')):.4f} |" if turned else "")
        + f" {e.get('v', float('nan')):.4f} |"
        + "".join(f" {e.get(site, float('nan')):.4f} |" for site in sites)
        + (f" {e.get('logits', float('nan')):.4f} |" if held else "")
        + (f" {e.get('logits_mean', float('nan')):.4f} |" if compared else "")
        + (f" {e.get('transfer_before', float('nan')):.4f} | {e.get('transfer_after', float('nan')):.4f} |"
           f" {int(e.get('transfer_steps', 0))} |" if trained else "")
        for layer, e in sorted(errors.items())
    )
    licence = "".join(f"{k}: {json.dumps(v)}\n" for k, v in card_licence(Path(cfg.model_dir)).items())
    text = f"""---
{licence}library_name: transformers
tags: [gqakit, {"multi-head-latent-attention" if plan.latent else "grouped-query-attention"}]
---
# {named(Path(cfg.model_dir)).name} converted to {name}

Made by gqakit {__version__} from `{cfg.model_dir}`{f" with `{command}`" if command else ""}.

| | |
|---|---|
| architecture | {plan.own_class[1] + f" (gqakit's own, from {plan.architecture})" if plan.own_class else
                  f"{ARCHITECTURE} (stock, from {plan.architecture})" if plan.latent else plan.architecture}{
f" (re-hosted: {plan.rehosted.describe()})" if plan.rehosted else ""} |
| attention heads | {plan.num_attention_heads} |
| K/V heads | {plan.num_key_value_heads} -> {"a fitted latent" if plan.latent_fit else f"{plan.groups} ({plan.mode})"} |
{encoder_row}{attention_row}| method | {_method_name(plan)}{seed} |
| head_dim | {plan.head_dim} |
| {bytes_label} | {kv_change(plan)}{_slides(plan)} |
| dtype | {cfg.dtype} |
{_method_rows(cfg, plan, calibration)}
{reads}
{"" if plan.exact else chr(10) + "**Note:** " + exactness_note(plan) + chr(10)}{
chr(10) + "**Runtime:** " + plan.spec.runtime_note + chr(10) if plan.spec.runtime_note else ""}{
chr(10) + "**Loading:** " + own_class_note(plan) + chr(10) if plan.own_class else ""}
{_error_heading(plan, held, trained)}

{_TRANSFER_NOTE.format(start=start) if trained else ""}
| layer | k_proj |{f" k_proj over positions 0-{plan.context - 1:,} |" if turned else ""} v_proj |{
"".join(f" {site} |" for site in sites)}{" held-out logits |" if held else ""}{
" held-out logits, mean-pooled |" if compared else ""}{
" held-out attention output at the start | after transfer | steps |" if trained else ""}
|---|---|---|{"---|" if turned else ""}{"---|" * len(sites)}{"---|" if held else ""}{"---|" if compared else ""}{
"---|---|---|" if trained else ""}
{rows}
{_against_mean(plan, errors, calibration is not None)}"""
    path.write_text(readable(text), encoding="utf-8")


def readable(text: str) -> str:
    """`text` as valid UTF-8: bytes of a path that are not UTF-8 (Python's surrogate escapes) become \\xNN."""
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that no byte decoded to
        raw = text.encode("utf-8", "backslashreplace")
    return raw.decode("utf-8", "backslashreplace")

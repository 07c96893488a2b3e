"""Per-rank memory of an uptraining run, before any work: `gqakit uptrain RECIPE --plan` prints it and
`check_fits` refuses (one line: the numbers and the fix) a run that would not fit.

Parameters are counted exactly (`model_count.py`): from the safetensors headers, or by building the model (and the
teacher) from its config.json on the meta device (shapes, no storage); tied weights count once. The rest is arithmetic.
N parameters, N_t the trainable ones under `trainable`, W processes, L decoder layers, h hidden size, a / g query / K/V
heads of size d, I the MLP width, V the vocabulary, n = batch_size * ceil(seq_len / context_parallel) tokens per rank
per micro-step; c bytes of the compute dtype (2 with bf16/fp16, else 4), s bytes of the residual stream (2 under fsdp
with bf16, whose policy casts the parameters; else 4: ddp's autocast keeps fp32 weights, so the stream stays fp32).
shard(X) = sum over X's tensors of ceil(rows / W) * row size, the busiest rank's share under FSDP2 (dim 0 split into W
equal, padded chunks); X under ddp.

  parameters       4 shard(N)            fp32 master weights (the loop loads fp32)
  gradients        4 shard(N_t)          fp32, trainable parameters only
  optimizer        8 shard(N_t)          AdamW's exp_avg and exp_avg_sq, fp32 (its 4-byte `step` per tensor left out)
  adamw step       4 shard(N_t)          during optimizer.step only: foreach AdamW's sqrt(exp_avg_sq) temporary
  ddp buckets      4 N_t                 ddp, W > 1: accelerate's DDP has gradient_as_bucket_view=False, which keeps
                                         a second copy of the gradients in its buckets (torch DDP docs)
  teacher          4 shard(N_teacher)    frozen, fp32 as the loop loads it
  fsdp gather      c (R + R_teacher + 2 Lmax) + 4 Lmax_t
                                         fsdp: FSDP2 does not reshard the root unit (embeddings, final norm, head:
                                         R parameters) after forward, so it stays gathered through backward (the
                                         teacher's, run under no_grad, stays gathered); about two decoder layers are
                                         gathered at a time (the one computing, the one prefetched: Lmax, the largest
                                         of student and teacher); one layer's unsharded fp32 gradient (Lmax_t) waits
                                         for its reduce-scatter
  fsdp no-sync     4 N_t                 fsdp with gradient_accumulation_steps > 1: while gradient sync is off,
                                         FSDP2 accumulates UNSHARDED gradients, in the reduce dtype (fp32)
  autocast copies  c N_lin               ddp with bf16/fp16: half-precision copies of the Linear weights (N_lin),
                                         the trainable ones cached by autocast until the forward ends, all of them
                                         kept by autograd until backward when not checkpointing
  activations      n (L A + F)           without activation checkpointing (minus the first layer's input norm
                                         when the embeddings are frozen: its input needs no gradient)
                   n (L h s + A + F)     with it (per decoder layer, as transformers does): every layer's input,
                                         plus one layer's activations recomputed in backward
  logits           12 n V                cross-entropy's fp32 log-probabilities (kept for backward), and in
                                         backward their fp32 gradient and the logits' (3 x 4 bytes)
  distillation     (c + 28) n V          with a teacher: its logits, and the KL's fp32 tensors at its peak
                                         (7 x 4 bytes, two of which it keeps for backward)
                   8 n V + 16 n k        with distill_top_k = k: the student's fp32 log-softmax (kept for
                                         backward) and its gradient, the teacher's top-k fp32 probabilities and
                                         int64 indices; the teacher's full logits exist only during its forward,
                                         which runs before the student's (smaller than the backward phase)

A and F are the bytes per token autograd keeps for one decoder layer and for the final norm and head:
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (eq. 2,
sbh(34 + 5as/h) for GPT with 16-bit activations), redone for a Llama-style decoder (RMSNorm, RoPE,
SwiGLU, no dropout) with exact attention that keeps no score matrix (sdpa, flash, gqakit's tiled
kernel keep q, k, v, the output and an fp32 logsumexp: Dao et al. 2022), so the 5as/h term goes:

  norm     = 4h + 4 + [norm weights train] h s    transformers' RMSNorm computes in fp32: its fp32 input
             (or upcast) and rsqrt, and for its weight's gradient the normalised input
  feed(k)  = the input of k trainable projections reading one norm's output, kept for their weight
             gradients: k h c under autocast (one cast copy each), else h s once; 0 when k = 0
  A = 2 norm + feed(q, k, v trainable) + feed(gate, up trainable) + (2ad + 2gd) c + 4a + 3I c + [down trains] I c
      (q and k after RoPE, v, the output that o_proj reads as a view, the logsumexp; SiLU's input, its
      output and up's output, kept by their product; the product, down_proj's input)
  F = norm + feed(lm_head trainable)

tests/uptrain/test_uptrain_plan.py checks these against the tensors autograd really saves for a tiny Llama.
Left out: RoPE tables and token ids, the teacher's per-layer transients under no_grad, the ring's K/V
blocks in flight (context_parallel), the CUDA context and allocator fragmentation (keep a few GB
spare).

The total is the peak of a step, not the sum of the lines: the loop sets gradients to None before each
step and backward allocates them as it frees the activations, so

  total = held + max(activations + logits + distillation + fsdp no-sync [+ gradients when
                     gradient_accumulation_steps > 1 keeps them across micro-steps], gradients + adamw step)

where `held` is every other line. tests/uptrain/test_uptrain_plan.py measures a tiny Llama's peak with torch's
MemTracker: the total is at or above it, by at most 20%.
"""
from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

from gqakit.common import launcher
from gqakit.common.errors import GqakitError
from gqakit.common.sizes import parse_size
from gqakit.uptrain.config import MIXED_PRECISION, SHARDING, TRAINABLE, UptrainConfig
from gqakit.uptrain.model_count import ModelCount, count_model
from gqakit.uptrain.sharding import strategy

GB = 10**9
# What trains under each `trainable`, per Llama-style layer: (norm weights, of q/k/v, of gate/up, down, lm_head)
_TRAINS = {"all": (True, 3, 2, True, True), "attention": (False, 3, 0, False, False),
           "kv": (False, 2, 0, False, False)}


def parse_device_memory(value) -> int:
    """--device-memory / device_memory in bytes."""
    return parse_size(value, "device memory", "80GB (80 x 10^9 bytes) or 24GiB (24 x 2^30 bytes)")


def _gb(nbytes: int) -> str:
    return f"{nbytes / GB:.2f}"


def _processes(n: int) -> str:
    return f"{n} process" + ("es" if n != 1 else "")


def _dtypes(cfg: UptrainConfig) -> tuple[int, int, bool]:
    """(compute bytes c, residual-stream bytes s, autocast over fp32 weights?)"""
    return strategy(cfg.sharding).activation_dtypes(cfg.mixed_precision)


def tokens_per_rank(cfg: UptrainConfig) -> int:
    """Tokens one rank holds per micro-step: its sequences, each cut in context_parallel pieces."""
    return cfg.batch_size * math.ceil(cfg.seq_len / cfg.context_parallel)


def activation_bytes(m: ModelCount, cfg: UptrainConfig, checkpointing: bool) -> int:
    """Bytes autograd keeps for the decoder of one rank's micro-step (see the module docstring)."""
    c, s, autocast = _dtypes(cfg)
    norms, qkv, gate_up, down, head = _TRAINS[cfg.trainable]
    h, a, g, d, inter = m.hidden, m.heads, m.kv_heads, m.head_dim, m.intermediate
    norm = 4 * h + 4 + (h * s if norms else 0)

    def feed(k: int) -> int:
        return 0 if k == 0 else k * h * c if autocast else h * s

    layer = 2 * norm + feed(qkv) + feed(gate_up) + (2 * a * d + 2 * g * d) * c + 4 * a + 3 * inter * c + \
        (inter * c if down else 0)
    final = norm + feed(int(head))
    if checkpointing:
        per_token = m.layers * h * s + layer + final
    else:  # frozen embeddings: the first norm's input needs no gradient, so it keeps nothing
        per_token = m.layers * layer - (0 if norms else norm) + final
    return tokens_per_rank(cfg) * per_token


@dataclasses.dataclass(frozen=True)
class Line:
    name: str
    bytes: int
    how: str
    phase: str = "held"  # held (the whole step) | backward | gradients | step: see `peak`


@dataclasses.dataclass(frozen=True)
class Fix:
    change: str
    total: int
    fits: bool
    combined: bool = False  # several changes together, tried when none fits alone


def _lines(cfg: UptrainConfig, world: int, m: ModelCount, t: ModelCount | None) -> tuple[list[Line], Line]:
    """The plan's lines, and the activations line under the other gradient_checkpointing choice."""
    c, _, autocast = _dtypes(cfg)
    fsdp = strategy(cfg.sharding).shards_state
    W = world if fsdp else 1
    over = f", sharded over {world}" if fsdp else ""
    dtype = {2: "bf16" if cfg.mixed_precision != "fp16" else "fp16", 4: "fp32"}[c]
    trained = m.trainable[cfg.trainable]
    lines = [Line("parameters", 4 * m.shard(W), f"fp32 master weights of {m.total:,}{over}"),
             Line("gradients", 4 * m.shard(W, cfg.trainable), f"fp32, {trained:,} trainable{over}", "gradients"),
             Line("optimizer", 8 * m.shard(W, cfg.trainable), f"AdamW exp_avg + exp_avg_sq, fp32{over}"),
             Line("adamw step", 4 * m.shard(W, cfg.trainable), "optimizer.step's sqrt(exp_avg_sq), fp32", "step")]
    if not fsdp and world > 1:
        lines.append(Line("ddp buckets", 4 * trained, "DDP's copy of the gradients (gradient_as_bucket_view=False)"))
    if t is not None:
        lines.append(Line("teacher", 4 * t.shard(W), f"fp32 frozen weights of {t.total:,}{over}"))
    if fsdp:
        biggest = max(m.layer, t.layer if t else 0)
        roots = m.root + (t.root if t else 0)
        lines.append(Line("fsdp gather", c * (roots + 2 * biggest) + 4 * m.layer_trainable[cfg.trainable],
                          f"{dtype}: root{'s' if t else ''} ({roots:,}) + 2 layers ({biggest:,} each) gathered, "
                          "1 layer's fp32 gradient", "backward"))
        if cfg.gradient_accumulation_steps > 1:
            lines.append(Line("fsdp no-sync", 4 * trained, "unsharded fp32 gradients accumulated while sync is off",
                              "backward"))
    if autocast:
        n = m.linear_trainable[cfg.trainable] if cfg.gradient_checkpointing else m.linear
        lines.append(Line("autocast copies", c * n, f"{dtype} copies of {n:,} Linear weights", "backward"))
    n, V = tokens_per_rank(cfg), m.vocab
    act_dtype = dtype if c == 4 or fsdp else f"{dtype} (fp32 residual stream)"
    how = {True: "with activation checkpointing", False: "no activation checkpointing"}
    ckpt = cfg.gradient_checkpointing
    lines.append(Line("activations", activation_bytes(m, cfg, ckpt), f"{act_dtype}, {how[ckpt]}", "backward"))
    other = Line("activations", activation_bytes(m, cfg, not ckpt), how[not ckpt])
    lines.append(Line("logits", 12 * n * V, f"fp32 log-probs + 2 gradients, {n:,} tokens x {V:,}", "backward"))
    if t is not None and cfg.distill_top_k is not None:
        k = min(cfg.distill_top_k, V)
        lines.append(Line("distillation", 8 * n * V + 16 * n * k,
                          f"top-{k}: the student's fp32 log-softmax and its gradient, {n:,} x {V:,}, + the teacher's "
                          f"top-k probabilities and indices", "backward"))
    elif t is not None:
        lines.append(Line("distillation", (c + 28) * n * V, f"teacher logits + the KL's fp32 tensors, {n:,} x {V:,}",
                          "backward"))
    return lines, other


def peak(lines, gradient_accumulation_steps: int) -> int:
    """A step's peak: the held lines, plus the larger of the backward phase (activations, logits...; with
    the gradients when accumulation keeps them across micro-steps) and the optimizer step's."""
    phase = {name: sum(line.bytes for line in lines if line.phase == name)
             for name in ("held", "backward", "gradients", "step")}
    backward = phase["backward"] + (phase["gradients"] if gradient_accumulation_steps > 1 else 0)
    return phase["held"] + max(backward, phase["gradients"] + phase["step"])


def _total(cfg: UptrainConfig, world: int, m: ModelCount, t: ModelCount | None) -> int:
    return peak(_lines(cfg, world, m, t)[0], cfg.gradient_accumulation_steps)


def _largest(fits, high: int) -> int:
    """The largest b in 1..high with fits(b), by bisection (fits must hold for every b below one that fits:
    with b sequences per micro-step below the global batch, every line of the plan grows with b); 1 if none."""
    low = 1
    if not fits(low):
        return 1
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _fixes(cfg: UptrainConfig, world: int, m: ModelCount, t: ModelCount | None, memory: int) -> list[Fix]:
    """Every single change that lowers the peak, with its total; if none fits alone, the first combination
    that does (or the last tried)."""
    replace = dataclasses.replace
    fixes, now = [], _total(cfg, world, m, t)

    def add(change: str, new: UptrainConfig, w: int = world) -> None:
        total = _total(new, w, m, t)
        if total < now:
            fixes.append(Fix(change, total, total <= memory))

    def ranks(new: UptrainConfig) -> int | None:
        """The fewest processes (world * 2^k, k <= 10) on which `new` fits, if any."""
        scale = range(11) if strategy(new.sharding).shards_state else range(1)
        return next((world << k for k in scale if _total(new, world << k, m, t) <= memory), None)

    fsdp = replace(cfg, sharding="fsdp")
    sharded = strategy(cfg.sharding).shards_state
    if not sharded and world > 1:
        add("sharding=fsdp", fsdp)
    more = ranks(fsdp)
    if more is not None and more > world:
        add(f"{more} processes" if sharded else f"sharding=fsdp on {more} processes", fsdp, more)
    if not cfg.gradient_checkpointing:
        add("gradient_checkpointing=true", replace(cfg, gradient_checkpointing=True))
    if cfg.mixed_precision == "no":
        add("mixed_precision=bf16", replace(cfg, mixed_precision="bf16"))
    rings = [p for p in range(cfg.context_parallel + 1, world + 1) if world % p == 0 and cfg.seq_len >= 2 * p]
    if rings:
        p = next((p for p in rings if _total(replace(cfg, context_parallel=p), world, m, t) <= memory), rings[-1])
        add(f"context_parallel={p}", replace(cfg, context_parallel=p))
    if cfg.trainable != "kv" and m.trainable["kv"] is not None:
        add("trainable=kv", replace(cfg, trainable="kv"))
    if cfg.batch_size > 1:
        def smaller(b: int) -> UptrainConfig:  # the same global batch in more micro-steps
            return replace(cfg, batch_size=b, gradient_accumulation_steps=math.ceil(
                cfg.batch_size * cfg.gradient_accumulation_steps / b))

        b = _largest(lambda b: _total(smaller(b), world, m, t) <= memory, cfg.batch_size - 1)
        add(f"batch_size={b} with gradient_accumulation_steps={smaller(b).gradient_accumulation_steps}", smaller(b))
    if any(f.fits for f in fixes):
        return fixes
    new, changes = cfg, []
    for change, key, value in (("sharding=fsdp", "sharding", "fsdp"), ("gradient_checkpointing=true",
                               "gradient_checkpointing", True), ("mixed_precision=bf16", "mixed_precision", "bf16"),
                               ("batch_size=1", "batch_size", 1), ("trainable=kv", "trainable", "kv")):
        if getattr(new, key) == value or (key == "trainable" and m.trainable["kv"] is None):
            continue
        new, changes = replace(new, **{key: value}), [*changes, change]
        w = ranks(new)
        if w is not None:
            on = f" on {w} processes" if w != world else ""
            return [*fixes, Fix(" + ".join(changes) + on, _total(new, w, m, t), True, combined=True)]
    w = world << 10 if strategy(new.sharding).shards_state else world
    return [*fixes, Fix(" + ".join(changes) + f" on {w} processes", _total(new, w, m, t), False, combined=True)]


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The per-rank memory lines of a recipe on `world` processes, and whether they fit the device."""

    cfg: UptrainConfig
    world: int
    model: ModelCount
    teacher: ModelCount | None
    lines: tuple[Line, ...]
    other_activations: Line  # the activations under the other gradient_checkpointing choice
    device_memory: int | None = None
    device_source: str = ""
    fixes: tuple[Fix, ...] = ()

    def __getitem__(self, name: str) -> int:
        """Bytes of line `name` (0 when the plan has no such line)."""
        return sum(line.bytes for line in self.lines if line.name == name)

    @property
    def total(self) -> int:
        """The peak of a step (see `peak`)."""
        return peak(self.lines, self.cfg.gradient_accumulation_steps)

    @property
    def state(self) -> int:
        """Parameters + gradients + optimizer state."""
        return self["parameters"] + self["gradients"] + self["optimizer"]

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.total <= self.device_memory

    def advice(self) -> str:
        """Which changes would make the plan fit, with their totals."""
        good = [f"{f.change} ({_gb(f.total)} GB)" for f in self.fixes if f.fits and not f.combined]
        short = [f"{f.change} ({_gb(f.total)} GB)" for f in self.fixes if not f.fits and not f.combined]
        if good:
            alone = f"; not enough alone: {'; '.join(short)}" if short else ""
            return "fits with any one of: " + "; ".join(good) + alone
        both = next((f for f in self.fixes if f.combined), None)
        if both is not None and both.fits:
            return f"no single change fits ({'; '.join(short)}); together {both.change} fit ({_gb(both.total)} GB)"
        even = f"; even {both.change} would need {_gb(both.total)} GB" if both is not None else ""
        tried = "; ".join(short) or "no option left"
        return f"nothing gqakit can change fits ({tried}){even}; use devices with more memory"

    def refusal(self) -> str:
        parts = ", ".join(f"{line.name} {_gb(line.bytes)}" for line in self.lines if line.bytes)
        return (f"uptrain needs {_gb(self.total)} GB per rank at its peak (GB: {parts}) on "
                f"{_processes(self.world)} with sharding={self.cfg.sharding}, but the device has "
                f"{_gb(self.device_memory)} GB ({self.device_source}); "
                f"{self.advice()}")


def _validate(cfg: UptrainConfig, world: int) -> None:
    for name, allowed in (("sharding", SHARDING), ("trainable", TRAINABLE), ("mixed_precision", MIXED_PRECISION)):
        if getattr(cfg, name) not in allowed:
            raise GqakitError(f"{name}={getattr(cfg, name)!r} is not one of {', '.join(allowed)}")
    for name, value in (("batch_size", cfg.batch_size), ("seq_len", cfg.seq_len),
                        ("context_parallel", cfg.context_parallel), ("processes", world)):
        if not isinstance(value, int) or value <= 0:
            raise GqakitError(f"{name}={value!r} must be a positive integer")
    if world % cfg.context_parallel:
        raise GqakitError(f"context_parallel={cfg.context_parallel} does not divide {_processes(world)}; plan for a "
                          f"multiple of {cfg.context_parallel} processes (--processes N)")


def plan_memory(cfg: UptrainConfig, world: int, device_memory: int | None = None, device_source: str = ""
                ) -> MemoryPlan:
    """Per-rank memory of `cfg` on `world` processes, from the model's (and teacher's) config.json only;
    with `device_memory` (bytes) it also says whether it fits and, if not, what would."""
    _validate(cfg, world)
    m = count_model(cfg.model)
    if m.trainable[cfg.trainable] is None:
        raise GqakitError(f"trainable={cfg.trainable} does not apply to {m.architecture} (no separate K/V "
                          "projections gqakit knows of); use trainable=attention or trainable=all")
    t = count_model(cfg.teacher) if cfg.teacher else None
    lines, other = _lines(cfg, world, m, t)
    plan = MemoryPlan(cfg, world, m, t, tuple(lines), other, device_memory, device_source)
    if plan.fits is False:
        plan = dataclasses.replace(plan, fixes=tuple(_fixes(cfg, world, m, t, device_memory)))
    return plan


def _may_have_gpus() -> bool:
    """Whether this machine shows an NVIDIA or AMD GPU driver: only then is torch loaded to ask it (a plan on a
    machine without one stays torch-free)."""
    return Path("/proc/driver/nvidia/gpus").is_dir() or Path("/dev/kfd").exists() or Path("/dev/nvidiactl").exists()


def detect_device_memory() -> tuple[int | None, str]:
    """(bytes, where from) of this process's device: the GPU's total memory, or on CPU the machine's
    MemAvailable shared by its LOCAL_WORLD_SIZE processes; (None, ...) when unknown."""
    if _may_have_gpus():
        import torch

        if torch.cuda.is_available():
            index = launcher.local_rank() % torch.cuda.device_count()
            props = torch.cuda.get_device_properties(index)
            return props.total_memory, f"cuda:{index} ({props.name})"
    try:
        found = re.search(r"^MemAvailable:\s+(\d+)\s+kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
    except OSError:
        found = None
    if found is None:
        return None, "unknown device memory"
    local = launcher.local_world_size()
    return int(found.group(1)) * 1024 // local, f"this machine's available memory / {local} local process(es)"


def resolve_device_memory(given: int | str | None, cfg: UptrainConfig) -> tuple[int | None, str]:
    """(bytes, where from): `given`, else the recipe's device_memory, else this machine's device."""
    if given is not None:
        where = f"{given:,} bytes given" if isinstance(given, int) else f"device memory {given}"
        return parse_device_memory(given), where
    if cfg.device_memory is not None:
        return parse_device_memory(cfg.device_memory), f"device_memory={cfg.device_memory}"
    return detect_device_memory()


def check_fits(cfg: UptrainConfig, world: int, device_memory_bytes: int | None = None) -> MemoryPlan | None:
    """Before any work: raise GqakitError (the numbers and the fix) when `cfg` on `world` processes does
    not fit the device memory (given, else the recipe's device_memory, else detected); None when unknown."""
    from gqakit.hf.folder import model_folder

    memory, source = resolve_device_memory(device_memory_bytes, cfg)
    config = model_folder(cfg.model).config
    if config.get("is_encoder_decoder") and (device_memory_bytes is not None or cfg.device_memory is not None):
        raise GqakitError(f"{source} asks for a memory check, and the memory plan models decoder-only transformers: "
                          f"{cfg.model} is an encoder-decoder ({(config.get('architectures') or ['?'])[0]}); drop it "
                          "(encoder-decoder runs are not checked against device memory)")
    if memory is None or config.get("is_encoder_decoder"):  # not planned: count_model
        return None
    plan = plan_memory(cfg, world, memory, source)
    if not plan.fits:
        raise GqakitError(plan.refusal())
    return plan


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a table: GB per rank per line, the total and the verdict."""
    cfg, m, t = plan.cfg, plan.model, plan.teacher
    head = [f"uptrain memory plan: {cfg.model} ({m.architecture}), {m.total:,} parameters, "
            f"{m.trainable[cfg.trainable]:,} trainable (trainable={cfg.trainable})"
            + (f"; teacher {cfg.teacher}, {t.total:,} parameters" if t else ""),
            f"{_processes(plan.world)}, sharding={cfg.sharding}, mixed_precision={cfg.mixed_precision}, "
            f"gradient_checkpointing={str(cfg.gradient_checkpointing).lower()}, "
            f"context_parallel={cfg.context_parallel}: "
            f"{cfg.batch_size} x {math.ceil(cfg.seq_len / cfg.context_parallel):,} tokens per rank per micro-step", ""]
    when = {"held": "always", "backward": "fwd-bwd", "gradients": "bwd-step", "step": "step"}
    rows = [(line.name, _gb(line.bytes), when[line.phase], line.how) for line in plan.lines]
    rows = [(n, g, w, h + (f" ({plan.other_activations.how}: {_gb(plan.other_activations.bytes)})"
                           if n == "activations" else "")) for n, g, w, h in rows]
    accumulates = cfg.gradient_accumulation_steps > 1
    rows.append(("total", _gb(plan.total), "peak", "always + the larger of fwd-bwd"
                 + (" + bwd-step (accumulation keeps gradients)" if accumulates else "") + " and bwd-step + step"))
    if plan.device_memory is not None:
        rows.append(("device memory", _gb(plan.device_memory), "", plan.device_source))
    width = max(len(g) for _, g, _, _ in rows)
    table = [f"{'per rank':<16} {'GB':>{width}}  {'when':<8}  what"] + \
        [f"{n:<16} {g:>{width}}  {w:<8}  {h}".rstrip() for n, g, w, h in rows]
    if plan.fits is None:
        verdict = f"fit: unknown ({plan.device_source}); give --device-memory SIZE, e.g. 80GB"
    elif plan.fits:
        verdict = (f"fits: {_gb(plan.device_memory - plan.total)} GB to spare (GB = 10^9 bytes; keep a few for the "
                   "CUDA context and allocator fragmentation)")
    else:
        verdict = f"does not fit: {_gb(plan.total - plan.device_memory)} GB over; {plan.advice()}"
    return "\n".join(head + table + [verdict])


def describe_memory_plan(cfg: UptrainConfig, processes: int | None = None) -> str:
    """`gqakit uptrain RECIPE --plan`: the table for `processes` (default the recipe's num_processes, or 1)."""
    if processes is not None and cfg.num_processes is not None and processes != cfg.num_processes:
        raise GqakitError(f"--processes {processes} plans a launch that the recipe's num_processes={cfg.num_processes} "
                          f"refuses; plan --processes {cfg.num_processes}, or override num_processes={processes}")
    world = processes if processes is not None else cfg.num_processes or 1
    memory, source = resolve_device_memory(None, cfg)
    return format_plan(plan_memory(cfg, world, memory, source))

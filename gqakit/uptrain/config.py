"""`gqakit uptrain`'s recipe: one frozen dataclass, and the checks that run before any work starts.

    gqakit uptrain recipes/uptrain_gqa4.yaml steps=50 lr=3e-4

Budget, in the GQA paper's terms: `alpha: 0.05` is 5% of the source model's pretraining tokens, read
from the `pretraining.json` the model folder carries (conversion copies it); otherwise give `steps` or
`tokens`. One optimizer step consumes `batch_size * gradient_accumulation_steps * data-parallel ranks`
sequences of `seq_len` tokens (the global batch), whatever the number of processes.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from gqakit.attention import kinds as attention_kinds
from gqakit.common import dtypes
from gqakit.common.atomic import inside
from gqakit.common.errors import GqakitError
from gqakit.common.options import SEED_MAX, check_fields, option, options_given
from gqakit.common.recipes import to_dict
from gqakit.hf.config_defaults import rope_of
from gqakit.hf.fields import N_POSITIONS_TYPES, context_length
from gqakit.uptrain import sharding

TRAINABLE = ("all", "attention", "kv")
ATTENTION = attention_kinds.CHOICES
LONG_CONTEXT = attention_kinds.LONG_CONTEXT
MIXED_PRECISION = ("no", "bf16", "fp16")
SHARDING = sharding.NAMES
SAVE_DTYPES = dtypes.WITH_AUTO
BUDGET_RECORD = "pretraining.json"  # hf.folder.PRETRAINING_RECORD


@dataclasses.dataclass(frozen=True)
class UptrainConfig:
    """Every option of `gqakit uptrain`; YAML recipes and `key=value` overrides map onto it 1:1."""

    model: str  # the converted checkpoint folder to uptrain
    output_dir: str  # run folder: checkpoints/, metrics.csv, loss.png, and at the end the final model
    data: tuple[str, ...] = ()  # .txt files (one document each), or .jsonl/.json/.parquet files/folders
    text_column: str = "text"
    target_column: str | None = None  # encoder-decoders: train on rows' (text_column -> target_column) pairs
    eval_data: tuple[str, ...] = ()  # held-out documents; empty: hold out `eval_fraction` of the packed sequences
    eval_fraction: float = option(0.02, at_least=0, below=0.5)
    eval_sequences: int = option(16, above=0)  # at most this many held-out sequences per evaluation
    # budget: exactly one of alpha (needs the model's pretraining record), tokens, steps
    alpha: float | None = option(None, above=0)
    tokens: int | None = option(None, above=0)
    steps: int | None = option(None, above=0)
    # batch and sequence
    seq_len: int = option(512, at_least=2)  # one token has no next token to learn in context
    batch_size: int = option(8, above=0)  # sequences per process per micro-step
    gradient_accumulation_steps: int = option(1, above=0)
    # optimiser and schedule: AdamW, linear warmup, cosine decay to min_lr_ratio * lr
    lr: float = option(3e-4, above=0)
    min_lr_ratio: float = option(0.1, at_least=0, at_most=1)
    warmup_steps: int = option(0, at_least=0)
    warmup_fraction: float = option(0.05, at_least=0, at_most=1)  # used when warmup_steps is 0
    weight_decay: float = option(0.0, at_least=0)
    betas: tuple[float, ...] = option((0.9, 0.95), length=2, at_least=0, below=1)
    grad_clip: float = option(1.0, at_least=0)
    trainable: str = option("all", choices=TRAINABLE)  # kv: only the K/V projections (and key norms)
    # loss: next-token cross-entropy, plus optional distillation from the original (MHA) model
    teacher: str | None = None
    distill_weight: float = option(0.5, at_least=0, at_most=1)  # loss = (1-w) CE + w T^2 KL(teacher || student)
    distill_temperature: float = option(1.0, above=0)
    distill_top_k: int | None = option(None, at_least=1)  # keep only the teacher's k largest logits per position
    # compute
    mixed_precision: str = option("no", choices=MIXED_PRECISION)  # accelerate's autocast; weights stay fp32
    gradient_checkpointing: bool = False
    attention: str = option("default", choices=ATTENTION)  # see gqakit.attention; the ring applies it too
    window: int | None = option(None, above=0)
    sinks: int | None = option(None, at_least=0)
    attention_options: dict | None = None  # any other option of the kind, e.g. {stride: 128} for attention=sparse
    context_parallel: int = option(1, above=0, metavar="P", remember=True,  # ranks sharing one sequence; the rest: DP
                                   help="split each sequence over P processes with ring attention (= "
                                        "context_parallel=P)", default_text="the recipe's context_parallel, else 1")
    sharding: str = option("ddp", choices=SHARDING)  # ddp: every process holds all; fsdp: FSDP2, state sharded
    device_memory: str | None = option(None, metavar="SIZE", remember=True,  # what the fit check plans for
                                       help="memory per rank, e.g. 80GB or 24GiB (= device_memory=SIZE)",
                                       default_text="this machine's")
    num_processes: int | None = option(None, above=0)  # expected world size: refuse to run silently on fewer processes
    # bookkeeping
    seed: int = option(0, at_least=0, at_most=SEED_MAX)
    log_every: int = option(1, above=0)
    eval_every: int = option(0, at_least=0)  # 0: only at the end
    checkpoint_every: int = option(50, above=0)  # a crash loses at most this many steps
    keep_checkpoints: int = option(2, above=0)
    delete_checkpoints: bool = True  # remove checkpoints/ once the final model is saved
    save_dtype: str = option("auto", choices=SAVE_DTYPES)  # final weights; auto = the source checkpoint's
    threads: int | None = option(None, above=0)  # torch CPU threads per process
    progress: bool = option(True, flag="-q/--quiet", invert=True, remember=True, help="no progress bar")
    force: bool = option(False, remember=True, help="start over even if output_dir holds a run")
    # data at scale: data files are tokenised once into a token cache (gqakit.uptrain.data.token_build)
    cache_dir: str | None = None  # where; default $GQAKIT_CACHE_DIR, else ~/.cache/gqakit/tokens
    num_proc: int = option(1, above=0)  # processes that tokenise (the stream is the same for any number)

    def __post_init__(self):
        check_fields(self)  # types and ranges, as declared beside each field

    def to_dict(self) -> dict:
        return to_dict(self)

    def use_options(self) -> dict:
        """The `gqakit.attention.use` options the recipe gives (window, sinks, attention_options)."""
        return use_options(self.attention, self.window, self.sinks, self.attention_options)


def use_options(attention: str, window: int | None, sinks: int | None, extra: dict | None) -> dict:
    """The `gqakit.attention.use` options of a recipe's attention keys; one the kind does not take is refused."""
    return attention_kinds.attention_options(attention, {"window": window, "sinks": sinks}, extra,
                                             extra_name="attention_options", flag=str, kind_flag="attention=")


@dataclasses.dataclass(frozen=True)
class Budget:
    steps: int
    tokens_per_step: int
    source: str  # how the step count was derived, for the record

    @property
    def tokens(self) -> int:
        return self.steps * self.tokens_per_step


def pretraining_tokens(model: str) -> int | None:
    """The source model's pretraining token count, when its folder records it."""
    from gqakit.hf.folder import model_folder

    return model_folder(model).pretraining_tokens


def resolve_budget(cfg: UptrainConfig, data_parallel: int) -> Budget:
    """Optimizer steps and tokens per step for this recipe on `data_parallel` replicas."""
    per_step = cfg.batch_size * cfg.gradient_accumulation_steps * data_parallel * cfg.seq_len
    given = [k for k in ("alpha", "tokens", "steps") if getattr(cfg, k) is not None]
    if len(given) != 1:
        raise GqakitError(f"give exactly one budget: alpha, tokens or steps (got {', '.join(given) or 'none'}); "
                          "e.g. alpha=0.05 or steps=100")
    if cfg.steps is not None:
        return Budget(cfg.steps, per_step, f"steps={cfg.steps}")
    if cfg.tokens is not None:
        return Budget(math.ceil(cfg.tokens / per_step), per_step, f"tokens={cfg.tokens}")
    pretrained = pretraining_tokens(cfg.model)
    if pretrained is None:
        raise GqakitError(f"alpha={cfg.alpha} needs the source model's pretraining token count, but {cfg.model} has "
                          f"no {BUDGET_RECORD} with 'pretraining_tokens'; give steps=N or tokens=N instead")
    return Budget(max(1, round(cfg.alpha * pretrained / per_step)), per_step,
                  f"alpha={cfg.alpha} of {pretrained:,} pretraining tokens")


def _check_paths(cfg: UptrainConfig) -> None:
    """The inputs and the output folder, and the data keys that the data's kinds would leave unread."""
    from gqakit.common.overlap import refuse_shared
    from gqakit.hf.folder import model_folder
    from gqakit.uptrain.data.sources import refuse_unread_text_column, resolve_source

    # each a readable file, a folder of them, a save_to_disk folder, a token cache, or hf:NAME
    sources = [resolve_source(path) for path in (*cfg.data, *cfg.eval_data)]
    given = options_given(cfg)
    if "text_column" in given:
        refuse_unread_text_column(sources, f"text_column={cfg.text_column}", "text_column")
    for key in ("num_proc", "cache_dir"):
        if key in given and all(source.kind == "cache" for source in sources):
            raise GqakitError(f"{key}={getattr(cfg, key)} is for tokenising raw data, and every data and eval_data "
                              f"entry is a token cache already; drop {key}")
        if key in given and cfg.target_column is not None:
            raise GqakitError(f"{key}={getattr(cfg, key)} is for tokenising raw data into token caches, and "
                              f"target_column={cfg.target_column} pairs are read and tokenised in memory; drop {key}")
    out = Path(cfg.output_dir)
    if cfg.cache_dir is not None:
        cache = Path(cfg.cache_dir).expanduser()
        if cache.exists() and not cache.is_dir():
            raise GqakitError(f"cache_dir {cfg.cache_dir} is a file; give a folder for the token caches")
        if inside(cache, out) or inside(out, cache):
            raise GqakitError(f"cache_dir {cfg.cache_dir} overlaps output_dir {out}; keep the token caches outside "
                              "the run folder")
    inputs = (("model", cfg.model), ("teacher", cfg.teacher), *(("data", d) for d in cfg.data),
              *(("eval_data", d) for d in cfg.eval_data))
    for name, path in inputs:  # the run folder may be replaced (force) or written into: it holds no input
        if path is not None and not path.startswith("hf:") and (inside(Path(path), out) or inside(out, Path(path))):
            raise GqakitError(f"output_dir {out} overlaps the {name} path {path}; choose an output_dir outside it")
    for held in cfg.eval_data:
        refuse_shared(("eval_data", held), [("data", d) for d in cfg.data],
                      "hold out a text that is not in data (or drop eval_data: data's last documents are held out)")
    if not cfg.eval_data:  # data's last documents are held out: a text listed twice would be trained on too
        from gqakit.uptrain.data.token_cache import refuse_repeated_texts

        refuse_repeated_texts(cfg.data, "list each text once in data, or give eval_data of its own")
    for path in (cfg.model, cfg.teacher):
        if path is not None:
            model_folder(path).tensors  # config.json, and safetensors weights that are all there (headers only)
    if not model_folder(cfg.model).has_tokenizer:
        raise GqakitError(f"{cfg.model} holds no tokenizer files; copy the tokenizer of the source model into it")


def _check_seq2seq(cfg: UptrainConfig, arch: str) -> None:
    """Refuse, in one line each, what encoder-decoder uptraining does not do."""
    if cfg.context_parallel > 1:
        raise GqakitError(f"context_parallel={cfg.context_parallel} splits one decoder sequence over processes, but "
                          f"{arch} is an encoder-decoder; use context_parallel=1")
    if cfg.attention != "default":
        raise GqakitError(attention_kinds.position_bias_refusal(f"the encoder-decoder {arch}", cfg.attention,
                                                                "attention=default"))


def _check_model_options(cfg: UptrainConfig, model_config: dict) -> None:
    """Attention options, the trainable subset and the teacher, from config.json alone."""
    from types import SimpleNamespace

    from gqakit.attention.masks import AttentionOptionError

    from gqakit.attention.options import normalise_options
    from gqakit.hf.architectures.rehost import attention_layout

    if cfg.attention != "default":
        try:
            normalise_options(cfg.attention, cfg.use_options(), SimpleNamespace(**model_config))
        except AttentionOptionError as e:
            raise GqakitError(f"attention={cfg.attention}: {e}") from None
    arch = (model_config.get("architectures") or ["?"])[0]
    seq2seq = bool(model_config.get("is_encoder_decoder"))
    if cfg.target_column is not None and not seq2seq:
        raise GqakitError(f"target_column={cfg.target_column} trains an encoder-decoder on input/target pairs, but "
                          f"{arch} is a decoder, which learns from one text; drop target_column")
    if seq2seq:
        _check_seq2seq(cfg, arch)
    if cfg.trainable == "kv":
        spec = attention_layout(arch)
        if spec is None or spec.fused:
            why = "fuses them with Q" if spec is not None else "is not in gqakit's architecture tables"
            raise GqakitError(f"trainable=kv needs separate K/V projections, but {arch} {why}; use "
                              "trainable=attention or trainable=all")
    given = options_given(cfg)  # set to another value than the field's default
    for key in ("distill_top_k", "distill_weight", "distill_temperature"):
        if cfg.teacher is None and key in given:
            raise GqakitError(f"{key}={getattr(cfg, key)} needs a teacher to distil from; set teacher=PATH (the model "
                              f"the student was converted from) or drop {key}")
    if cfg.teacher is not None and cfg.distill_weight == 0:
        raise GqakitError("distill_weight=0 gives the teacher no part in the loss, yet it would be loaded and run; "
                          "drop teacher, or give distill_weight a share (e.g. 0.5)")
    _check_held_out(cfg, given)
    if cfg.warmup_steps > 0 and "warmup_fraction" in given:
        raise GqakitError(f"warmup_fraction={cfg.warmup_fraction} is read only when warmup_steps is 0, and it is "
                          f"{cfg.warmup_steps}; drop one of them")
    if cfg.teacher is not None:
        from gqakit.hf.folder import model_folder

        teacher = model_folder(cfg.teacher).config
        vocab = teacher.get("vocab_size")
        if cfg.distill_top_k is not None and isinstance(vocab, int) and cfg.distill_top_k > vocab:
            raise GqakitError(f"distill_top_k={cfg.distill_top_k} exceeds the teacher's vocab_size {vocab}; use at "
                              f"most {vocab} (or null for the full distribution)")
        if bool(teacher.get("is_encoder_decoder")) != seq2seq:
            kinds = ("an encoder-decoder", "a decoder") if seq2seq else ("a decoder", "an encoder-decoder")
            raise GqakitError(f"the model is {kinds[0]} but the teacher {cfg.teacher} {kinds[1]}; distil from the "
                              "model the student was converted from")
        if teacher.get("vocab_size") != model_config.get("vocab_size"):
            raise GqakitError(f"teacher {cfg.teacher} has vocab_size {teacher.get('vocab_size')} but the model "
                              f"{model_config.get('vocab_size')}; distil from the model the student was converted from")
        _check_teacher(cfg, teacher, seq2seq)


def _check_teacher(cfg: UptrainConfig, teacher: dict, seq2seq: bool) -> None:
    """The teacher runs its own full attention over the student's sequences, and its logits are read id by id: it
    must have their positions, and the student's token ids."""
    from gqakit.hf.folder import model_folder

    limit = context_length(teacher)
    if limit and cfg.seq_len > limit and not seq2seq:  # the student's long-context attention is not the teacher's
        raise GqakitError(f"teacher {cfg.teacher} runs full attention over seq_len={cfg.seq_len} positions, past its "
                          f"{limit}-position context; lower seq_len to {limit} or drop the teacher")
    if model_folder(cfg.teacher).has_tokenizer:  # a teacher without tokenizer files is read by the model's ids
        from transformers import AutoTokenizer

        ours, theirs = (AutoTokenizer.from_pretrained(p).get_vocab() for p in (cfg.model, cfg.teacher))
        if ours != theirs:
            differ = sum(theirs.get(token) != i for token, i in ours.items())
            raise GqakitError(f"teacher {cfg.teacher}'s tokenizer gives {differ:,} tokens other ids than the model's; "
                              "its logits would be distilled id by id into other tokens: distil from a teacher with "
                              "the model's tokenizer")


def _check_held_out(cfg: UptrainConfig, given: set) -> None:
    """Held-out keys that the recipe's other keys leave unread are refused, not ignored."""
    if cfg.eval_data and "eval_fraction" in given and cfg.eval_fraction > 0:  # 0 says "hold nothing out": true
        raise GqakitError(f"eval_fraction={cfg.eval_fraction} holds out part of data, but eval_data is given and is "
                          "held out instead; drop eval_fraction or eval_data")
    if not cfg.eval_data and cfg.eval_fraction == 0 and "eval_every" in given:  # (eval_sequences, a cap, may stay)
        raise GqakitError(f"eval_every={cfg.eval_every} evaluates held-out data, but the recipe holds none "
                          "(eval_fraction=0 and no eval_data); give eval_data or eval_fraction > 0, or drop eval_every")


def check(cfg: UptrainConfig) -> dict:
    """Validate a recipe before any work starts; returns the model's config.json."""
    from gqakit.hf.folder import model_folder

    model_config = model_folder(cfg.model).config  # field types and ranges were checked when cfg was built
    if not cfg.data:
        raise GqakitError("the recipe has no training data; set data: [FILE.txt | FILE.jsonl | FOLDER, ...]")
    _check_paths(cfg)
    _check_model_options(cfg, model_config)
    import torch

    if cfg.mixed_precision == "fp16" and not torch.cuda.is_available():
        raise GqakitError("mixed_precision=fp16 needs a GPU (on CPU autocast would silently train in fp32); "
                          "use mixed_precision=bf16 or no")
    sharding.strategy(cfg.sharding).check(cfg.mixed_precision, {"model": cfg.model, "teacher": cfg.teacher})
    limit = context_length(model_config)
    if limit and cfg.seq_len > limit and cfg.attention not in LONG_CONTEXT:
        raise GqakitError(f"seq_len={cfg.seq_len} is above {cfg.model}'s limit of {limit} positions; lower seq_len "
                          "or train a long-context attention (attention=sliding window=N, or attention=sinks)")
    text = model_config.get("text_config") or model_config
    if limit and cfg.seq_len > limit and text.get("model_type") in TABLE_POSITIONS:  # a window does not help
        raise GqakitError(f"seq_len={cfg.seq_len} is above {cfg.model}'s limit of {limit} positions, and "
                          f"{text.get('model_type')} reads each position from a table that ends there, whatever "
                          f"attention={cfg.attention} masks; lower seq_len to {limit} or less")
    cfg.use_options()  # an option the kind does not take is refused, never dropped
    if cfg.context_parallel > 1 and cfg.attention not in ("default", "tiled", *LONG_CONTEXT):
        raise GqakitError(f"context_parallel runs ring attention with full, sliding-window or sink patterns, not "
                          f"attention={cfg.attention}; use context_parallel=1 for it")
    if cfg.context_parallel > 1 and cfg.teacher is not None and cfg.attention in LONG_CONTEXT:
        raise GqakitError(f"distillation with context_parallel runs the teacher inside the student's ring, which "
                          f"would give it the student's attention={cfg.attention}; drop the teacher or use "
                          "attention=default")
    if cfg.context_parallel > 1:
        _check_ring(cfg, model_config, limit)
    return model_config


# model types whose positions come from a table that ends at the context (learned, or GPT-J's precomputed RoPE):
# those whose context is n_positions, and OPT
TABLE_POSITIONS = (*N_POSITIONS_TYPES, "opt")


def _check_ring(cfg: UptrainConfig, model_config: dict, limit: int | None) -> None:
    """context_parallel > 1: what ring attention, one MaskSpec over a padded layout, cannot run exactly."""
    from transformers import AutoConfig

    P = cfg.context_parallel
    text = model_config.get("text_config") or model_config
    layer_types = set(text.get("layer_types") or ())
    if len(layer_types) > 1:
        raise GqakitError(f"context_parallel does not support models that mix attention layer types "
                          f"({', '.join(sorted(layer_types))}); train this model with context_parallel=1")
    chunk = text.get("attention_chunk_size")
    if layer_types - {"full_attention", "sliding_attention"} or (not layer_types and chunk):
        raise GqakitError(f"context_parallel runs ring attention with full or sliding-window masks, and {cfg.model} "
                          f"attends in chunks (attention_chunk_size {chunk}), which the ring would drop; train this "
                          "model with context_parallel=1")
    if cfg.seq_len < 2 * P:
        raise GqakitError(f"seq_len={cfg.seq_len} is shorter than 2 * context_parallel={2 * P}; "
                          "lower context_parallel or raise seq_len")
    padded = -(-cfg.seq_len // (2 * P)) * 2 * P  # RingLayout.padded_len: end padding takes positions past seq_len
    # harmless under fixed RoPE (padding is masked and unscored); a position table ends there, and dynamic / longrope
    # scaling changes every token's frequencies once the largest position passes its original context
    rope = rope_of(text)
    kind = rope.get("rope_type")
    if kind in ("dynamic", "longrope"):
        limit = rope.get("original_max_position_embeddings") or text.get("original_max_position_embeddings") or limit
    ends = text.get("model_type") in TABLE_POSITIONS or kind in ("dynamic", "longrope")
    if ends and limit and cfg.seq_len <= limit < padded:
        raise GqakitError(f"seq_len={cfg.seq_len} is padded to {padded} positions for context_parallel={P} (a "
                          f"multiple of 2 x {P}), past {cfg.model}'s {limit}; use a seq_len that is a multiple of "
                          f"{2 * P}, e.g. {padded - 2 * P}")
    if cfg.teacher is not None:  # the teacher runs inside the student's ring, under its MaskSpec
        windows = {path: getattr(AutoConfig.from_pretrained(path).get_text_config(decoder=True), "sliding_window", None)
                   for path in (cfg.model, cfg.teacher)}
        seen = {path: None if w is None or w >= cfg.seq_len else w for path, w in windows.items()}  # what it hides
        if seen[cfg.model] != seen[cfg.teacher]:
            raise GqakitError(f"distillation with context_parallel runs the teacher inside the student's ring, with "
                              f"the student's attention window ({windows[cfg.model] or 'none'}), but teacher "
                              f"{cfg.teacher} attends within {windows[cfg.teacher] or 'no window'}; use a teacher "
                              "with the student's window, or context_parallel=1")

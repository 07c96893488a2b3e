"""`gqakit uptrain`: an explicit training loop; DDP through `accelerator.prepare`, FSDP2 through
`gqakit.uptrain.fsdp` (both average gradients over the processes).

One optimizer step = `gradient_accumulation_steps` micro-steps on every process. Each process's loss
is its summed token losses divided by the TOTAL target tokens of the step, times the number of
processes (DDP averages gradients over processes); so the update is the gradient of the mean token
loss of the global batch, whatever the split into micro-batches, data-parallel replicas and
context-parallel shards. That is what makes 2 processes equal 1 with the same global batch.
"""
from __future__ import annotations

import contextlib
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from gqakit.common.errors import GqakitError
from gqakit.common.options import SEED_MAX
from gqakit.hf.folder import model_folder
from gqakit.hf.loading import is_encoder_decoder
from gqakit.uptrain import modeling
from gqakit.uptrain.config import UptrainConfig, check, resolve_budget
from gqakit.uptrain.data.batches import BatchOrder, load_training_data
from gqakit.uptrain.data.pairs import load_pairs
from gqakit.uptrain.loss import cross_entropy_sum, distillation_sum, teacher_top_k, top_k_distillation_sum
from gqakit.uptrain.memory_plan import check_fits
from gqakit.uptrain.run.metrics import MetricsLog, plot
from gqakit.attention.registration import apply_attention
from gqakit.common.precision import bf16_cpu_warning
from gqakit.uptrain.parallel import SequenceParallel, sequence_parallel
from gqakit.uptrain.sharding import Strategy, strategy
from gqakit.uptrain.run.final import save_final, source_dtype
from gqakit.uptrain.run.folder import check_processes, plan_run, start_run
from gqakit.uptrain.run.lock import run_lock
from gqakit.uptrain.seq2seq import Seq2SeqObjective, objective
from gqakit.uptrain.run.checkpoints import (CHECKPOINTS, checkpoint_dirs, load_checkpoint, rank_record, save_checkpoint,
                                            set_rng_state)
from gqakit.uptrain.data.token_build import load_tokenizer


def _sums(model, teacher, seqs: torch.Tensor, temperature: float, sp: SequenceParallel, autocast,
          top_k: int | None = None, seq2seq: Seq2SeqObjective | None = None):
    """(cross-entropy sum, distillation sum or None) of this rank's share of sequences (B, T + 1);
    call it inside `sp.attention()`. With `top_k`, the teacher runs first and only its k largest logits per
    position are kept: its full logits are gone before the student's exist. With `seq2seq` (an encoder-decoder's
    objective), each row's span-corruption pair or input/target pair, the sums scaled as `uptrain.seq2seq` says."""
    if seq2seq is not None:
        kwargs, targets = seq2seq.batch(seqs)
        ce, kd = _model_sums(model, teacher, {**kwargs, "use_cache": False}, targets, temperature, autocast, top_k)
        return ce * seq2seq.scale, (None if kd is None else kd * seq2seq.scale)
    inputs, targets, positions = sp.shard(seqs)
    kwargs = {"input_ids": inputs, "position_ids": positions, "use_cache": False}
    return _model_sums(model, teacher, kwargs, targets, temperature, autocast, top_k)


def _model_sums(model, teacher, kwargs: dict, targets: torch.Tensor, temperature: float, autocast,
                top_k: int | None):
    def teacher_logits():
        with torch.no_grad(), autocast():
            out = teacher(**kwargs).logits
        if hasattr(teacher, "reshard"):  # FSDP keeps a root gathered after a forward without backward
            teacher.reshard()
        return out

    if teacher is not None and top_k is not None:
        probs, indices = teacher_top_k(teacher_logits(), top_k, temperature)  # the full logits die here
        logits = model(**kwargs).logits
        return cross_entropy_sum(logits, targets), top_k_distillation_sum(logits, probs, indices, targets, temperature)
    logits = model(**kwargs).logits  # (B, T_local, V)
    ce = cross_entropy_sum(logits, targets)
    kd = None if teacher is None else distillation_sum(logits, teacher_logits(), targets, temperature)
    return ce, kd


def rank_seed(seed: int, step: int, rank: int) -> int:
    """The seed of process `rank` from `step` on, where it has no saved random state (a first launch of several
    processes: step 0; a resharded resume): distinct per (step, rank), within numpy's 0..2**32 - 1, which
    accelerate's set_seed seeds (a resharded resume past step 4,294 overflowed it)."""
    return (seed + 1_000_003 * step + rank) % (SEED_MAX + 1)


def _checkpoint(accelerator, model, optimizer, scheduler, out: Path, step: int, keep: int, recipe: dict,
                rank_state: dict) -> None:
    """Every rank: save resumable checkpoint `step` (model, optimizer, scheduler, loss scale, rank state)."""
    trainer_state = {"scheduler": scheduler.state_dict(),
                     "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None}
    save_checkpoint(out, step, model=model, optimizer=getattr(optimizer, "optimizer", optimizer),
                    trainer_state=trainer_state, rank_state=rank_state, rank=accelerator.process_index,
                    recipe=recipe, is_main=accelerator.is_main_process, barrier=accelerator.wait_for_everyone,
                    keep=keep)


def _enable_checkpointing(model) -> None:
    enable = getattr(model, "activation_checkpointing_enable", None)  # the name from transformers 5.x on
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _combine(ce, kd, distill_weight: float):
    return ce if kd is None else (1 - distill_weight) * ce + distill_weight * kd


@torch.no_grad()
def evaluate(model, data: torch.Tensor, batch_size: int, seq_len: int, sp: SequenceParallel, accelerator,
             seq2seq: Seq2SeqObjective | None = None) -> float:
    """Mean held-out cross-entropy (nats/token) over `data`, split over the data-parallel ranks. Every
    rank runs the same number of forward passes (FSDP gathers weights collectively): a rank whose share
    has run out repeats a sequence and does not count it."""
    model = accelerator.unwrap_model(model)  # no DDP buffer broadcasts; FSDP modules stay as they are
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    mine = data[sp.dp_rank :: sp.data_parallel]
    batches = math.ceil(math.ceil(len(data) / sp.data_parallel) / batch_size)
    for b in range(batches):
        seqs = mine[b * batch_size : (b + 1) * batch_size]
        counted = len(seqs) > 0
        with accelerator.autocast(), sp.attention():
            ce, _ = _sums(model, None, (seqs if counted else data[:1]).to(accelerator.device), 1.0, sp,
                          accelerator.autocast, seq2seq=seq2seq)
        total[0] += ce.double() if counted else 0.0
    if seq2seq is not None and seq2seq.counts_targets:  # input/target pairs: their real targets
        total[1] = seq2seq.targets(mine)
    else:  # every rank counts its share of the targets
        total[1] = len(mine) * seq_len / sp.context_parallel
    total = accelerator.reduce(total, reduction="sum")
    if hasattr(model, "reshard"):  # FSDP keeps the root unsharded after a forward without backward
        model.reshard()
    model.train(was_training)
    return float(total[0] / total[1]) if total[1] > 0 else float("nan")


def _models(cfg: UptrainConfig, sp: SequenceParallel, accelerator):
    """(student, teacher or None, attention options, (trainable, total) parameter counts). With
    fsdp both models are built sharded, never whole on a rank."""
    counts, options = {}, {}

    def prepare_student(model):
        options.update(apply_attention(model, cfg.attention, cfg.use_options()))
        sp.prepare_model(model)
        counts["params"] = modeling.select_trainable(model, cfg.trainable)
        if cfg.gradient_checkpointing:
            _enable_checkpointing(model)

    def prepare_teacher(teacher):
        teacher.eval().requires_grad_(False)
        sp.prepare_teacher(teacher)

    how = strategy(cfg.sharding)
    model = how.load(cfg.model, accelerator.device, cfg.mixed_precision, prepare_student)
    teacher = None if cfg.teacher is None else how.load(cfg.teacher, accelerator.device, cfg.mixed_precision,
                                                        prepare_teacher, role="teacher")
    return model, teacher, options, counts["params"]


def uptrain(cfg: UptrainConfig, command: str = "", on_step: Callable[[int, dict, torch.nn.Module], None] | None = None
            ) -> dict:
    """Run (or resume) an uptraining; returns the run record. `on_step(step, row, model)` is called on
    every rank after every optimizer step with the unwrapped model (tests use it to interrupt a run)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    check(cfg)  # everything a user can get wrong, before any work starts
    world = check_processes(cfg.num_processes, cfg.context_parallel)
    check_fits(cfg, world)  # a run that cannot fit is refused with the numbers and the fix, before any work
    recipe = cfg.to_dict()
    budget = resolve_budget(cfg, world // cfg.context_parallel)
    # the launch, recorded in checkpoints: a resume needs the same steps and tokens per step
    # (run_folder.plan_run); the same processes too for every rank to continue its own RNG streams
    shape = {"processes": world, "context_parallel": cfg.context_parallel, "steps": budget.steps,
             "tokens_per_step": budget.tokens_per_step}
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    plan_run(cfg.output_dir, recipe, cfg.force, shape)  # refuse a folder we may not use before touching it

    # accelerate keeps one process-wide AcceleratorState and refuses a second Accelerator with other
    # settings; several runs in one process (the grid, tests) reset it, keeping the process group.
    # Under fsdp, mixed precision is FSDP2's policy, not autocast.
    AcceleratorState._reset_state()
    accelerator = Accelerator(cpu=not torch.cuda.is_available(),
                              mixed_precision=strategy(cfg.sharding).autocast(cfg.mixed_precision))
    out = Path(cfg.output_dir)
    say = _Say(accelerator.is_main_process and cfg.progress)
    if cfg.mixed_precision == "bf16" and accelerator.device.type == "cpu" and accelerator.is_main_process:
        slow = bf16_cpu_warning("mixed_precision=bf16", "mixed_precision=no")
        if slow:
            _Say(True)(f"uptrain: warning: {slow}")
    with run_lock(out, _Say(True)) if accelerator.is_main_process else contextlib.nullcontext():
        accelerator.wait_for_everyone()
        resume_from = plan_run(out, recipe, cfg.force, shape)  # again, now that no other run can change it
        return _train(cfg, accelerator, say, recipe, budget, shape, resume_from, command, on_step)


class _Say:
    """Start-up news on stderr from the main process (silenced by progress=false)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __call__(self, line: str) -> None:
        if self.enabled:
            print(line, file=sys.stderr, flush=True)


def _train(cfg: UptrainConfig, accelerator, say: _Say, recipe: dict, budget, shape: dict, resume_from: Path | None,
           command: str, on_step) -> dict:
    """The run itself, holding the run folder's lock: load, (resume,) train, save the final model."""
    from accelerate.utils import set_seed

    how = strategy(cfg.sharding)
    is_main = accelerator.is_main_process
    out = Path(cfg.output_dir)
    sp = sequence_parallel(cfg.context_parallel, cfg.seq_len, accelerator)
    set_seed(cfg.seed)

    tokenizer = load_tokenizer(cfg.model)
    model_config = model_folder(cfg.model).config
    seq2seq = objective(tokenizer, model_config, cfg) if is_encoder_decoder(model_config) else None
    held_out = seq2seq.held_out() if seq2seq is not None else None  # held-out masks do not follow the seed
    say(f"uptrain: reading {len(cfg.data)} data source{'s' if len(cfg.data) > 1 else ''}")
    if cfg.target_column is not None:  # input/target rows, in memory (every rank reads them)
        data = load_pairs(cfg, tokenizer)
    else:
        data = load_training_data(cfg, tokenizer, is_main=is_main, barrier=accelerator.wait_for_everyone)
    order = BatchOrder(len(data.train), cfg.batch_size, cfg.gradient_accumulation_steps, sp.data_parallel, cfg.seed)
    fingerprint = data.fingerprint()
    if resume_from is not None:
        _check_same_data(rank_record(resume_from, 0), fingerprint, resume_from)
    say(f"uptrain: loading {cfg.model}" + (f" and the teacher {cfg.teacher}" if cfg.teacher else "") +
        f" ({cfg.sharding} over {accelerator.num_processes} process{'es' if accelerator.num_processes > 1 else ''})")
    model, teacher, attention_options, (trainable, total_params) = _models(cfg, sp, accelerator)
    optimizer = modeling.make_optimizer(model, cfg.lr, cfg.betas, cfg.weight_decay)
    warmup = modeling.warmup_steps(budget.steps, cfg.warmup_steps, cfg.warmup_fraction)
    if warmup > budget.steps:
        _Say(is_main)(f"uptrain: warning: warmup_steps={warmup} is longer than the run's {budget.steps} steps, so the "
                      f"learning rate never reaches lr={cfg.lr:g} (it peaks at {budget.steps / warmup:.0%} of it); "
                      "lower warmup_steps, or set warmup_steps=0 for warmup_fraction")
    elif warmup == budget.steps:  # no step is left for the cosine decay
        _Say(is_main)(f"uptrain: warning: the warmup ({warmup} steps) covers the whole run of {budget.steps}, so no "
                      f"step decays towards min_lr_ratio={cfg.min_lr_ratio:g}; lower the warmup for a cosine decay")
    scheduler = modeling.make_scheduler(optimizer, budget.steps, warmup, cfg.min_lr_ratio)
    model, optimizer = how.prepare(accelerator, model, optimizer)
    if is_main:
        start_run(out, recipe, fresh=resume_from is None)  # a failed start-up above leaves the folder as it was
    accelerator.wait_for_everyone()

    start = 0
    if resume_from is None and accelerator.num_processes > 1:
        # The weights are loaded alike on every rank; from here each rank draws its own dropout masks (its own data
        # under the same masks otherwise), from the stream a resharded resume at step 0 would derive. One process
        # keeps the recipe's seed as it was.
        set_seed(rank_seed(cfg.seed, 0, accelerator.process_index))
    if resume_from is not None:
        trainer_state = load_checkpoint(resume_from, model, getattr(optimizer, "optimizer", optimizer))
        scheduler.load_state_dict(trainer_state["scheduler"])
        if trainer_state.get("scaler") is not None and accelerator.scaler is not None:
            accelerator.scaler.load_state_dict(trainer_state["scaler"])  # fp16 loss scale
        saved = rank_record(resume_from, 0)
        mine = rank_record(resume_from, accelerator.process_index)
        start = saved["step"]
        if mine is not None and saved["shape"] == shape:
            set_rng_state(mine["rng"])  # the same launch: every process continues its own random streams
        else:  # resharded: no saved stream belongs to this process; derive one from (seed, step, rank)
            set_seed(rank_seed(cfg.seed, start, accelerator.process_index))
        if is_main:
            print(f"uptrain: resuming {out} from step {start} ({resume_from.name})", flush=True)
    log = MetricsLog(out, start, enabled=is_main)
    record_base = {"initial_eval_ppl": None}
    if start:
        record_base.update(saved.get("record", {}))
    if start == 0 and len(data.eval):
        say(f"uptrain: held-out loss before training ({len(data.eval)} sequences)")
        record_base["initial_eval_ppl"] = math.exp(evaluate(model, data.eval, cfg.batch_size, cfg.seq_len, sp,
                                                            accelerator, held_out))
        if is_main:
            log.log({"step": 0, "tokens": 0, "eval_loss": math.log(record_base["initial_eval_ppl"]),
                     "eval_ppl": record_base["initial_eval_ppl"]})

    bar = tqdm(total=budget.steps, initial=start, desc="uptrain", unit="step", disable=not (is_main and cfg.progress))
    t0, step_tokens, paused = time.perf_counter(), 0, 0.0  # paused: held-out evaluations and checkpoints
    earlier = saved.get("train_seconds", 0.0) if start else 0.0  # the loop's seconds in the launches before
    trained = [p for group in optimizer.param_groups for p in group["params"]]  # what the optimizer updates
    model.train()
    for step in range(start, budget.steps):
        optimizer.zero_grad(set_to_none=True)  # here, not after the step: on_step may read the gradients
        sums = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
        # the loss is the mean over the global batch's target tokens
        targets = _step_targets(data, order, step, cfg.gradient_accumulation_steps, sp, budget.tokens_per_step,
                                seq2seq)
        for micro in range(cfg.gradient_accumulation_steps):
            idx = order.indices(step, micro, sp.dp_rank)
            seqs = data.train[idx].to(accelerator.device)  # (B, T + 1)
            last = micro == cfg.gradient_accumulation_steps - 1
            # backward inside the attention context: gradient checkpointing re-runs the forward
            with _gradient_sync(how, accelerator, model, last), sp.attention():
                ce, kd = _sums(model, teacher, seqs, cfg.distill_temperature, sp, accelerator.autocast,
                               cfg.distill_top_k, seq2seq)
                loss = _combine(ce, kd, cfg.distill_weight) * accelerator.num_processes / targets
                accelerator.backward(loss)
            sums[0] += ce.detach().double()
            if kd is not None:
                sums[1] += kd.detach().double()
        grad_norm = float(how.clip(accelerator, model, trained, cfg.grad_clip or math.inf))  # global, every rank
        sums = accelerator.reduce(sums, reduction="sum") / targets
        lr = optimizer.param_groups[0]["lr"]  # the rate this step used
        step_tokens += budget.tokens_per_step
        done = step + 1
        row = {"step": done, "tokens": done * budget.tokens_per_step,
               "loss": float(_combine(sums[0], sums[1] if teacher is not None else None, cfg.distill_weight)),
               "ce": float(sums[0]), "kd": float(sums[1]) if teacher is not None else "",
               "lr": lr, "grad_norm": grad_norm, "tokens_per_s": step_tokens / (time.perf_counter() - t0 - paused)}
        # fp16's loss scaler skips a step with non-finite gradients by design; anything else non-finite has diverged
        if not math.isfinite(row["loss"]) or not (math.isfinite(grad_norm) or accelerator.scaler is not None):
            log.log(row)
            log.close()
            raise GqakitError(_diverged(out, done, row, cfg.lr))
        optimizer.step()
        scheduler.step()
        if (cfg.eval_every and done % cfg.eval_every == 0 or done == budget.steps) and len(data.eval):
            paused_at = time.perf_counter()
            row["eval_loss"] = evaluate(model, data.eval, cfg.batch_size, cfg.seq_len, sp, accelerator, held_out)
            paused += time.perf_counter() - paused_at
            row["eval_ppl"] = math.exp(row["eval_loss"])
        if done % cfg.log_every == 0 or "eval_loss" in row or done == budget.steps:
            log.log(row)
        bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:,.0f}")
        bar.update(1)
        if done % cfg.checkpoint_every == 0 and done < budget.steps:
            paused_at = time.perf_counter()
            _checkpoint(accelerator, model, optimizer, scheduler, out, done, cfg.keep_checkpoints, recipe,
                        {"step": done, "shape": shape, "data": order.position(done), "record": record_base,
                         "data_fingerprint": fingerprint, "train_seconds": earlier + time.perf_counter() - t0})
            paused += time.perf_counter() - paused_at
        if on_step is not None:
            on_step(done, row, accelerator.unwrap_model(model))
    bar.close()
    log.close()

    record = {
        **record_base, "recipe": recipe, "command": command,
        "budget": {"steps": budget.steps, "tokens_per_step": budget.tokens_per_step, "tokens": budget.tokens,
                   "source": budget.source},
        "warmup_steps": warmup,
        "global_batch": order.global_batch, "processes": accelerator.num_processes, "sharding": cfg.sharding,
        "data": data.describe(), "parameters": total_params, "trainable_parameters": trainable,
        "attention_options": attention_options,
        "final_eval_ppl": math.exp(log.rows[-1]["eval_loss"]) if is_main and log.rows and
        log.rows[-1].get("eval_loss") not in ("", None) else None,
        "save_dtype": source_dtype(cfg.model) if cfg.save_dtype == "auto" else cfg.save_dtype,
        "train_seconds": round(earlier + time.perf_counter() - t0, 1),
    }
    accelerator.wait_for_everyone()
    save_final(accelerator.unwrap_model(model), tokenizer, out, record, is_main=is_main,
               barrier=accelerator.wait_for_everyone)
    if is_main:
        plot(log.rows, out / "loss.png", title=f"uptrain {Path(cfg.model).name}")
        if cfg.delete_checkpoints:
            shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
    accelerator.wait_for_everyone()
    return record


def _check_same_data(saved: dict | None, now: dict, checkpoint: Path) -> None:
    """A resumed run trains on the sequences its checkpoint was trained on and scores the same held-out ones (its
    record's perplexity before training is compared with the one after): refused in one line when they changed
    (data or eval_data files rewritten, another tokenizer). Checkpoints made before fingerprints were kept pass."""
    was = (saved or {}).get("data_fingerprint")
    if was is None or was == now:
        return
    counts = [f"{key} {was[key]:,} -> {now[key]:,}" for key in ("train_sequences", "eval_sequences",
                                                                 "train_stream_tokens") if was[key] != now[key]]
    raise GqakitError(f"the data is not what {checkpoint.name} was trained on ({', '.join(counts) or 'other tokens'}"
                      f"): resuming would train on other text and compare perplexities of different held-out text; "
                      f"restore the data and eval_data files, or start over with force=true")


def _step_targets(data, order: BatchOrder, step: int, micro_steps: int, sp: SequenceParallel, tokens_per_step: int,
                  seq2seq: Seq2SeqObjective | None) -> int:
    """The target tokens of a step's global batch: `tokens_per_step`, or, where rows differ in them (input/target
    pairs), their count over every rank's rows, computed by every rank from the same deterministic order, so no
    process has to ask the others (windows read from disk are never read for this)."""
    if seq2seq is None or not seq2seq.counts_targets:
        return tokens_per_step
    return sum(seq2seq.targets(data.train[order.indices(step, m, r)]) for m in range(micro_steps)
               for r in range(sp.data_parallel))


def _diverged(out: Path, step: int, row: dict, lr: float) -> str:
    """The one line that stops a run whose loss or gradient norm is not finite."""
    kept = checkpoint_dirs(out)
    last = f"checkpoint {kept[-1].name} is kept" if kept else "no checkpoint was written yet"
    return (f"step {step}: the loss is {row['loss']:g} and the gradient norm {row['grad_norm']:g}, so training "
            f"diverged and no final model was written ({last}); lower lr (now {lr:g}), raise warmup_steps or "
            "set grad_clip, and start over with force=true")


def _gradient_sync(how: Strategy, accelerator, model, sync: bool):
    """Reduce gradients only on the last micro-step of an optimizer step."""
    return contextlib.nullcontext() if sync else how.hold_sync(accelerator, model)

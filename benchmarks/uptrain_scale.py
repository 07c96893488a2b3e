"""`gqakit uptrain` with sharding=ddp against sharding=fsdp on CPU processes: per-rank training state and
peak RSS at P = 1, 2, 4, and tokens/s against a bare PyTorch training loop.

A Llama-shaped model with random weights (default ~91M parameters: hidden 768, 12 layers, 12 heads,
intermediate 2048, untied head; vocabulary 4,096 of gqakit's embedded tokenizer, so the data tokenises
with it) is saved with its tokenizer in a scratch folder. Every cell is one `torchrun --standalone
--nproc_per_node P` launch of this file as a worker that calls `gqakit.uptrain.uptrain(cfg,
on_step=...)` with fp32 weights, batch B x T per process, AdamW, grad clip 1.0, one thread per process
(P = 1: a plain `python` process, as `gqakit uptrain` runs without a launcher):

  (a) training state per rank, counted exactly from the tensors the rank holds after step 1: the
      model's parameters and their .grad (tied weights once; DTensors by `.to_local()`, the rank's shard)
      and every tensor in the AdamW optimizer's state (exp_avg, exp_avg_sq, step), read in a global
      optimizer step post-hook (`torch.optim.optimizer.register_optimizer_step_post_hook`), as the loop
      does not pass its optimizer out. DDP's gradient buckets are NOT in this count (see the notes).
      Target: FSDP's state per rank within 10% of 1/P of DDP's at the same P.
  (b) memory per rank of one whole training step, two ways. RSS: the high-water mark (VmHWM,
      /proc/self/status) is reset (`5` > /proc/self/clear_refs) at the end of step 1 and read at the end
      of step 2, so it covers step 2 alone (zero_grad, forward, backward, gradient sync, clip, AdamW) with
      the optimizer state allocated. Held: the peak of glibc's bytes in use (mallinfo2), sampled after
      every aten op of step 2 by a TorchDispatchMode (step 2 is a warm-up step, never timed), plus the
      parameters that still lie on the checkpoint's memory map (transformers 5 loads safetensors without
      copying; found through /proc/self/maps): what the rank holds, without the freed heap glibc keeps.
      Both also before the model was built (after imports). On CPU the two differ a lot: glibc keeps most
      freed activation memory mapped (RSS), so RSS per rank falls far less with P than the state does;
      `--mmap-threshold 1048576` makes glibc return large frees at once (FSDP at P = 4, ~91M model: RSS after
      step 1 3x lower, step peak 1.8x).
  (c) tokens/s at P = 1 of a bare loop (AutoModelForCausalLM + AdamW, the same batch, loss = cross-entropy
      sum / tokens, the same clip; no gqakit, no accelerate) against gqakit with ddp and with fsdp, and at
      P = 2 ddp against fsdp: the median of per-step wall times after the warm-up steps (gqakit: between
      consecutive `on_step` calls, the measuring work excluded). Target: gqakit >= 0.9x the bare loop.

    python benchmarks/uptrain_scale.py --quick    # ~9M model, batch 2 x 128, P = 1 2 4, 1 launch each (~2 min)
    python benchmarks/uptrain_scale.py            # ~91M model, batch 4 x 256, P = 1 2 4; P = 1 launched
                                                  # twice, interleaved (10-15 min on 2 shared cores)
    python benchmarks/uptrain_scale.py --ranks 2 4 --speed-ranks --mmap-threshold 1048576   # memory only

Progress goes to stderr; stdout is only the markdown report. A benchmark, never a test.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _measure import ROOT, live_peak, logger, malloc_in_use, mib, reset_peak, status_kib

MEMORY_TARGET = 1.10  # FSDP state per rank <= 1.10 x (DDP state at the same P) / P
SPEED_TARGET = 0.90  # gqakit tokens/s at P = 1 >= 0.9 x the bare loop's
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int = 4096  # the embedded tokenizer's

    def label(self) -> str:
        return (f"Llama {self.layers}L h{self.hidden} {self.heads}H d{self.hidden // self.heads} "
                f"i{self.intermediate} v{self.vocab}")


PRESETS = {"100m": Shape(hidden=768, layers=12, heads=12, intermediate=2048),
           "10m": Shape(hidden=256, layers=8, heads=8, intermediate=768)}  # gqakit's reference model's shape


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(PRESETS), default="100m")
    p.add_argument("--tie", action="store_true", help="tie the LM head to the embeddings (default: untied)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="process counts P for the memory tables")
    p.add_argument("--speed-ranks", type=int, nargs="*", default=[1, 2],
                   help="P at which cells also run the timed steps (P = 1 is compared with the bare loop; "
                        "none: memory only)")
    p.add_argument("--batch", type=int, default=4, help="sequences per process per step")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (>= 2: step 2 is the memory step)")
    p.add_argument("--timed", type=int, default=4, help="timed steps after the warm-up")
    p.add_argument("--repeats", type=int, default=2,
                   help="launches of each P = 1 speed cell (bare, ddp, fsdp), interleaved in rotating order; "
                        "their timed steps are pooled")
    p.add_argument("--mmap-threshold", type=int, metavar="BYTES",
                   help="set MALLOC_MMAP_THRESHOLD_ in every worker: glibc then mmaps (and on free returns) "
                        "every allocation above BYTES, so RSS follows the memory in use (default: glibc's)")
    p.add_argument("--scratch", default="scratch", help="parent of the temporary work folder (default ./scratch)")
    p.add_argument("--keep", action="store_true", help="keep the work folder (model, run folders, worker logs)")
    p.add_argument("--quick", action="store_true",
                   help="~9M model, batch 2 x 128, 8 timed steps, 1 launch per cell (~2 min)")
    p.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)  # internal: one rank of a gqakit cell
    p.add_argument("--bare", metavar="SPEC", help=argparse.SUPPRESS)  # internal: the bare PyTorch loop
    args = p.parse_args(argv)
    if args.quick:
        args.shape, args.batch, args.seq, args.timed, args.repeats = "10m", 2, 128, 8, 1
    if args.warmup < 2:
        p.error("--warmup must be >= 2 (step 1 allocates the optimizer state, step 2 is the measured step)")
    return args


# ---------------------------------------------------------------------------------------------------
# Per-process measurements (run inside the workers)


def _status_bytes(key: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    return status_kib(key) * 1024


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t  # DTensor: this rank's shard
    return t.numel() * t.element_size()


def _model_bytes(model) -> dict:
    params = {id(p): p for p in model.parameters()}.values()  # tied weights once
    return {"param_bytes": sum(_local_bytes(p) for p in params),
            "grad_bytes": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
            "dtensors": sum(hasattr(p, "to_local") for p in params), "tensors": len(params)}


def _mapped_param_bytes(model) -> int:
    """Bytes of parameters whose storage still lies in a memory-mapped .safetensors file (transformers 5
    loads without copying): malloc does not count them, RSS does."""
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5].endswith(".safetensors"):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((lo, hi))
    total = 0
    for p in {id(p): p for p in model.parameters()}.values():
        t = p.to_local() if hasattr(p, "to_local") else p
        if any(lo <= t.data_ptr() < hi for lo, hi in ranges):
            total += t.numel() * t.element_size()
    return total


def _optimizer_bytes(optimizer) -> int:
    return sum(_local_bytes(v) for state in optimizer.state.values() for v in state.values() if hasattr(v, "numel"))


class Recorder:
    """Step times (between steps, own work excluded) and the memory figures of steps 1 and 2."""

    def __init__(self):
        self.res = {"base_rss": _status_bytes("VmRSS"), "base_live": malloc_in_use(), "times": {}}
        self._last, self._mode = None, None

    def optimizer_hook(self, optimizer, args, kwargs) -> None:
        if "optim_bytes" not in self.res:  # after step 1: the state exists from the first step on
            self.res["optim_bytes"] = _optimizer_bytes(optimizer)

    def step_end(self, step: int, model) -> None:
        _sync()  # on a GPU a step ends when its kernels do
        now = time.perf_counter()
        if self._last is not None:
            self.res["times"][step] = now - self._last
        if step == 1:
            self.res.update(_model_bytes(model))
            self.res["mapped_param_bytes"] = _mapped_param_bytes(model)
            self.res["load_peak_rss"] = _status_bytes("VmHWM")  # process peak: loading and step 1
            self.res["step1_rss"] = _status_bytes("VmRSS")
            self.res["step1_live"] = malloc_in_use()
            self.res["peak_reset"] = reset_peak()
            self._mode = live_peak()  # step 2 is a warm-up step: the sampling does not touch the timings
            self._mode.__enter__()
        elif step == 2:
            self._mode.__exit__(None, None, None)
            self.res["step_peak_rss"] = _status_bytes("VmHWM")
            self.res["step_peak_live"] = max(self._mode.top, malloc_in_use())
        self._last = time.perf_counter()


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def worker(spec_path: str) -> None:
    """One rank of a gqakit cell: uptrain the recipe, write rank-R.json."""
    import torch

    torch.set_num_threads(1)
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from gqakit.common import launcher
    from gqakit.common.recipes import load_recipe
    from gqakit.uptrain import UptrainConfig, uptrain

    spec = json.loads(Path(spec_path).read_text())
    rec = Recorder()  # after the imports, before the model is built
    cfg = load_recipe(UptrainConfig, spec["recipe"], spec["overrides"])
    register_optimizer_step_post_hook(rec.optimizer_hook)
    uptrain(cfg, on_step=lambda step, row, model: rec.step_end(step, model))
    Path(spec["result"], f"rank-{launcher.rank()}.json").write_text(json.dumps(rec.res))


def bare(spec_path: str) -> None:
    """The bare single-process loop: same model, batch, loss, clip and optimizer, no gqakit. The spec's `device`
    (default cpu) and `mixed_precision` ("bf16": autocast, as gqakit's recipe; default "no") say where and how."""
    import contextlib

    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    device = torch.device(spec.get("device", "cpu"))
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if spec.get("mixed_precision") == "bf16"
                else contextlib.nullcontext())
    rec = Recorder()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    ids = torch.tensor(tokenizer(Path(spec["text"]).read_text(encoding="utf-8"))["input_ids"])
    T, B = spec["seq"], spec["batch"]
    data = ids[: len(ids) // (T + 1) * (T + 1)].view(-1, T + 1)  # packed (N, T + 1)
    model = AutoModelForCausalLM.from_pretrained(  # without hub kernels, as gqakit loads (hf.compat.LOAD_KWARGS)
        spec["model"], dtype=torch.float32, use_kernels=False).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.0}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=spec["lr"], betas=(0.9, 0.95))
    model.train()
    for step in range(1, spec["steps"] + 1):
        optimizer.zero_grad(set_to_none=True)
        seqs = data[torch.randint(len(data), (B,))].to(device)  # (B, T + 1)
        with autocast:
            logits = model(input_ids=seqs[:, :-1], use_cache=False).logits  # (B, T, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), seqs[:, 1:].flatten(), reduction="sum") / (B * T)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec["grad_clip"])
        optimizer.step()
        if step == 1:
            rec.optimizer_hook(optimizer, (), {})
        rec.step_end(step, model)
    Path(spec["result"], "rank-0.json").write_text(json.dumps(rec.res))


# ---------------------------------------------------------------------------------------------------
# The driver


log = logger()


def make_model(path: Path, shape: Shape, tie: bool) -> int:
    """Save a random Llama of `shape` with the embedded tokenizer; returns its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from gqakit.reference import reference_model_path

    cfg = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.heads, head_dim=shape.hidden // shape.heads,
                      max_position_embeddings=2048, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0,
                      pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(reference_model_path() / name, path / name)
    return sum(p.numel() for p in model.parameters())


def _env(mmap_threshold: int | None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("WORLD_SIZE", None)
    if mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    return env


def run_cell(work: Path, name: str, cmd: list[str], spec: dict, P: int, env: dict) -> dict:
    """Run one cell; returns {"ranks": [per-rank dicts], "seconds": wall} or {"error": tail of its log}."""
    cell = work / name
    cell.mkdir()
    spec = {**spec, "result": str(cell)}
    (cell / "spec.json").write_text(json.dumps(spec))
    start = time.perf_counter()
    with open(cell / "log.txt", "w") as out:
        proc = subprocess.run([*cmd, str(cell / "spec.json")], env=env, stdout=out, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    files = [cell / f"rank-{r}.json" for r in range(P)]
    if proc.returncode != 0 or not all(f.is_file() for f in files):
        tail = (cell / "log.txt").read_text(errors="replace")[-3000:]
        log(f"  {name} FAILED (exit {proc.returncode}):\n{tail}")
        return {"error": tail, "seconds": seconds}
    log(f"  {name}: {seconds:.0f} s")
    return {"ranks": [json.loads(f.read_text()) for f in files], "seconds": seconds}


def recipe_file(work: Path, model: Path, text: Path, args) -> Path:
    import yaml

    recipe = {"model": str(model), "data": [str(text)], "seq_len": args.seq, "batch_size": args.batch,
              "lr": 3.0e-4, "warmup_steps": 1, "grad_clip": 1.0, "eval_fraction": 0.0, "threads": 1,
              "progress": False, "checkpoint_every": 10**9, "save_dtype": "bfloat16", "force": True}
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _state(rank: dict) -> int:
    return rank["param_bytes"] + rank["grad_bytes"] + rank["optim_bytes"]


def _step_times(runs: list[dict], warmup: int) -> list[float]:
    """Per-step wall times after warm-up, pooled over launches (a step ends when its slowest rank does)."""
    out = []
    for run in runs:
        steps = sorted(int(k) for k in run["ranks"][0]["times"] if int(k) > warmup)
        out += [max(r["times"][str(k)] for r in run["ranks"]) for k in steps]
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    if args.bare:
        bare(args.bare)
        return 0

    from gqakit.reference import HELDOUT_TEXT

    shape = PRESETS[args.shape]
    scratch = Path(args.scratch).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="uptrain-scale-", dir=scratch))
    this = str(Path(__file__).resolve())
    t_start = time.perf_counter()
    try:
        log(f"saving a random {shape.label()} in {work}")
        model, text = work / "model", Path(HELDOUT_TEXT)  # read in place: gqakit's token cache stays valid
        n_params = make_model(model, shape, args.tie)
        recipe = recipe_file(work, model, text, args)
        speed_steps = args.warmup + args.timed
        env = _env(args.mmap_threshold)

        bare_spec = {"model": str(model), "text": str(text), "seq": args.seq, "batch": args.batch, "lr": 3.0e-4,
                     "grad_clip": 1.0, "steps": speed_steps}

        def launch(kind: str, P: int, steps: int, tag: str) -> dict:
            if kind == "bare":
                log(f"bare PyTorch loop, P = 1, {steps} steps{tag}")
                return run_cell(work, f"bare-1{tag}", [sys.executable, this, "--bare"], bare_spec, 1, env)
            log(f"gqakit uptrain sharding={kind}, P = {P}, {steps} steps{tag}")
            # P = 1 runs as a plain process, as `gqakit uptrain` does without a launcher: under torchrun accelerate
            # sees LOCAL_RANK and wraps even one CPU process in DDP (gradient buckets, a 1-rank all-reduce)
            launcher = [] if P == 1 else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(P)]
            cmd = [sys.executable, *launcher, this, "--worker"]
            overrides = [f"sharding={kind}", f"steps={steps}", f"num_processes={P}",
                         f"output_dir={work / f'run-{kind}-{P}{tag}'}"]
            return run_cell(work, f"{kind}-{P}{tag}", cmd, {"recipe": str(recipe), "overrides": overrides}, P, env)

        cells: dict[tuple[str, int], list[dict]] = {}  # (run, P) -> launches; memory from the first
        trio = ["bare", "ddp", "fsdp"]
        for r in range(args.repeats if 1 in args.speed_ranks else 0):  # P = 1 side by side, rotating order
            for kind in trio[r % 3:] + trio[: r % 3]:
                cells.setdefault((kind, 1), []).append(launch(kind, 1, speed_steps, f"-r{r}"))
        for P in sorted(args.ranks):
            for kind in ("ddp", "fsdp"):
                if (kind, P) not in cells:
                    cells[(kind, P)] = [launch(kind, P, speed_steps if P in args.speed_ranks else 2, "")]
        report(args, shape, n_params, cells, time.perf_counter() - t_start)
        return 0 if not any("error" in c for c in cells.values()) else 1
    finally:
        if args.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def report(args, shape: Shape, n_params: int, cells: dict, seconds: float) -> None:
    import torch

    good = {key: [r for r in runs if "error" not in r] for key, runs in cells.items()}
    first = {key: runs[0] for key, runs in good.items() if runs}  # the memory figures: the first launch
    name = lambda kind: "bare PyTorch" if kind == "bare" else f"gqakit {kind}"  # noqa: E731
    print(f"`python {shlex.join(sys.argv)}`\n")
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, 1 thread per process, gloo; {shape.label()}"
          f"{', tied head' if args.tie else ', untied head'}, {n_params / 1e6:.1f}M parameters, fp32 weights, "
          f"AdamW; batch {args.batch} x {args.seq} tokens per process per step; glibc malloc "
          f"{'with MALLOC_MMAP_THRESHOLD_=' + str(args.mmap_threshold) if args.mmap_threshold else 'defaults'}; "
          f"total {seconds / 60:.1f} min\n")

    print("### (a) training state per rank after one optimizer step (exact tensor bytes, busiest rank)\n")
    print("| sharding | P | params MiB | grads MiB | AdamW state MiB | state MiB | vs DDP at P | vs DDP / P |")
    print("|---|---|---|---|---|---|---|---|")
    verdicts = []
    for P in sorted(args.ranks):
        ddp = max(map(_state, first[("ddp", P)]["ranks"])) if ("ddp", P) in first else None
        for kind in ("ddp", "fsdp"):
            if (kind, P) not in first:
                print(f"| {kind} | {P} | FAILED |  |  |  |  |  |")
                continue
            busiest = max(first[(kind, P)]["ranks"], key=_state)
            state = _state(busiest)
            print(f"| {kind} | {P} | {mib(busiest['param_bytes'])} | {mib(busiest['grad_bytes'])} | "
                  f"{mib(busiest['optim_bytes'])} | {mib(state)} | {f'{state / ddp:.3f}' if ddp else '-'} | "
                  f"{f'{state / (ddp / P):.3f}' if ddp else '-'} |")
            if kind == "fsdp" and ddp and P > 1:
                verdicts.append((state / (ddp / P) <= MEMORY_TARGET,
                                 f"P={P}: FSDP training state per rank is {state / (ddp / P):.3f}x of DDP's / P "
                                 f"(target <= {MEMORY_TARGET:.2f})"))

    print("\n### (b) memory per rank in a whole training step (MiB, busiest rank)\n")
    print("RSS from /proc/self/status. 'Held' = malloc's bytes in use (mallinfo2: the tensors and objects the "
          "rank holds, without the freed heap glibc keeps) plus parameters still on the checkpoint's memory map "
          "(transformers 5 loads safetensors without copying; malloc does not see them). Step 2 = the step "
          "after the first, with the optimizer state allocated. '+' = above the figure before the model was "
          "built.\n")
    print("| run | P | RSS before the model | RSS after step 1 | RSS peak, step 2 | + | vs DDP at P "
          "| params on the mmap | held after step 1, + | held peak, step 2, + | vs DDP at P |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [("bare", 1)] * (("bare", 1) in cells) + [(k, P) for P in sorted(args.ranks) for k in ("ddp", "fsdp")]
    rss_added = lambda r: r["step_peak_rss"] - r["base_rss"]  # noqa: E731
    held_added = lambda r: r["step_peak_live"] - r["base_live"] + r["mapped_param_bytes"]  # noqa: E731
    for key in rows:
        if key not in first:
            print(f"| {name(key[0])} | {key[1]} | FAILED |  |  |  |  |  |  |  |  |")
            continue
        ranks, ddp = first[key]["ranks"], first.get(("ddp", key[1])) if key[0] != "bare" else None
        cols = []
        for added in (rss_added, held_added):
            mine = max(map(added, ranks))
            ref = max(map(added, ddp["ranks"])) if ddp else None
            cols.append((mine, f"{mine / ref:.2f}" if ref else "-"))
        held1 = max(r["step1_live"] - r["base_live"] + r["mapped_param_bytes"] for r in ranks)
        print(f"| {name(key[0])} | {key[1]} | {mib(max(r['base_rss'] for r in ranks))} | "
              f"{mib(max(r['step1_rss'] for r in ranks))} | {mib(max(r['step_peak_rss'] for r in ranks))} | "
              f"{mib(cols[0][0])} | {cols[0][1]} | {mib(max(r['mapped_param_bytes'] for r in ranks))} | "
              f"{mib(held1)} | {mib(cols[1][0])} | {cols[1][1]} |")
    if not all(r.get("peak_reset") for run in first.values() for r in run["ranks"]):
        print("\n(VmHWM could not be reset on this machine: 'RSS peak, step 2' is the process peak.)")

    tokens = args.batch * args.seq
    med = {key: statistics.median(_step_times(runs, args.warmup)) for key, runs in good.items()
           if runs and key[1] in args.speed_ranks}
    speed_rows = [(k, 1) for k in ("bare", "ddp", "fsdp")] * (1 in args.speed_ranks) + \
        [(k, P) for P in sorted(args.speed_ranks) if P != 1 and P in args.ranks for k in ("ddp", "fsdp")]
    if speed_rows:
        print(f"\n### (c) throughput: median of per-step wall times after {args.warmup} warm-up steps\n")
        print("| run | P | launches x timed steps | median step s (min - max) | per-launch medians s "
              "| tokens/s (all ranks) | tokens/s per rank | vs bare loop | vs DDP at P |")
        print("|---|---|---|---|---|---|---|---|---|")
    for key in speed_rows:
        if key not in med:
            print(f"| {name(key[0])} | {key[1]} | FAILED |  |  |  |  |  |  |")
            continue
        P, times = key[1], _step_times(good[key], args.warmup)
        tps = P * tokens / med[key]
        vs_bare = f"{med[('bare', 1)] / med[key]:.2f}" if P == 1 and ("bare", 1) in med else "-"
        vs_ddp = f"{med[('ddp', P)] / med[key]:.2f}" if ("ddp", P) in med and key[0] != "bare" else "-"
        launches = " / ".join(f"{statistics.median(_step_times([run], args.warmup)):.2f}" for run in good[key])
        print(f"| {name(key[0])} | {P} | {len(good[key])} x {len(times) // len(good[key])} | {med[key]:.2f} "
              f"({min(times):.2f} - {max(times):.2f}) | {launches} | {tps:,.0f} | {tps / P:,.0f} | {vs_bare} "
              f"| {vs_ddp} |")
        if P == 1 and key[0] != "bare" and ("bare", 1) in med:
            ratio = med[("bare", 1)] / med[key]
            verdicts.append((ratio >= SPEED_TARGET, f"P=1: gqakit {key[0]} runs at {ratio:.2f}x the bare loop's "
                             f"tokens/s (target >= {SPEED_TARGET:.2f})"))

    print("\n### verdicts\n")
    for passed, text in verdicts:
        print(f"- {'PASS' if passed else 'FAIL'}: {text}")
    for key, runs in cells.items():
        for run in runs:
            if "error" in run:
                print(f"- FAILED: {name(key[0])} P={key[1]}; the end of its log:\n\n```\n{run['error']}\n```")
    load = os.getloadavg()
    repeats = (f"P = 1 cells ran {args.repeats}x in rotating order (bare, ddp, fsdp), their timed steps pooled. "
               if 1 in args.speed_ranks else "")
    launches = ", ".join(f"{k[0]}-{k[1]} " + "/".join(f"{r['seconds']:.0f}" for r in runs) for k, runs in cells.items())
    print(f"\nNotes: {os.cpu_count()} cores, shared: with P >= 2 processes of one thread each the ranks compete "
          f"with each other (and with anything else running), so P > 1 step times compare DDP with FSDP only. "
          f"{repeats}The state in (a) leaves out DDP's gradient buckets: accelerate's DDP keeps "
          f"gradient_as_bucket_view=False, a second copy of the gradients (P > 1 only: P = 1 runs without a "
          f"launcher, so without DDP; the buckets are in the RSS and held columns of (b)). "
          f"Load average at the end {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}. Wall seconds per launch: "
          f"{launches}.")

if __name__ == "__main__":
    sys.exit(main())

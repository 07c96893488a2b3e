"""Bodies of the spawned gloo processes for tests/attention/test_ring.py (each returns a picklable result).

`spawn(world, fn, payload, tmp)` forks `world` CPU processes on one gloo group, runs `fn(rank, world,
payload)` in each and returns the per-rank results. Many cases run in one group: start-up costs seconds.
"""
from __future__ import annotations

import datetime
import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessRaisedException


def spawn(world: int, fn: str, payload, tmp: Path) -> list:
    """Run worker `fn` (a name in this module) on `world` gloo ranks; returns the results in rank order."""
    tmp = Path(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    # fork: the children inherit the parent's imports (torch + transformers take seconds per process);
    # each child runs on one thread, as DataLoader workers do, which keeps fork-after-OpenMP safe.
    for attempt in range(2):
        try:
            mp.start_processes(_entry, args=(world, str(tmp / f"init{attempt}"), fn, payload, str(tmp)),
                               nprocs=world, join=True, start_method="fork")
            break
        except ProcessRaisedException as err:
            # gloo's own rendezvous failing ("connectFullMesh failed ... Connection closed by peer", seen once in
            # a loaded suite run) happens before any case runs: start the group once more; anything else fails
            if attempt or "connectFullMesh failed" not in str(err):
                raise
    results = [torch.load(tmp / f"result{r}.pt", weights_only=False) for r in range(world)]
    errors = [(r, res["error"]) for r, res in enumerate(results) if isinstance(res, dict) and "error" in res]
    if errors:  # lead with the rank that failed first: the others only saw their peer's socket close
        errors.sort(key=lambda e: "Connection" in e[1].splitlines()[-1])
        raise AssertionError("\n".join(f"rank {r} failed:\n{err}" for r, err in errors))
    return results


def _entry(rank: int, world: int, init: str, fn: str, payload, tmp: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # a hang fails instead of blocking CI
    try:
        result = globals()[fn](rank, world, payload)
    except Exception:  # hand the traceback to the parent, which fails the test with it
        result = {"error": traceback.format_exc()}
    torch.save(result, Path(tmp) / f"result{rank}.pt")
    dist.destroy_process_group()


# ---- attention cases --------------------------------------------------------------------------------

def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _one_case(rank: int, P: int, case: dict, group=None) -> dict:
    """Ring attention on this rank's shard; on ring rank 0, errors of the gathered results vs eager."""
    from gqakit.attention.masks import MaskSpec
    from gqakit.attention.reference import eager_reference
    from gqakit.attention.ring import STATS, RingLayout, ring_attention

    B, H, G, T, d = case.get("B", 2), case.get("H", 4), case["G"], case["T"], case.get("d", 8)
    spec = MaskSpec(**case.get("spec", {}))
    block = case.get("block", 8)
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    q = torch.randn(B, H, T, d, generator=gen)
    k, v = torch.randn(B, G, T, d, generator=gen), torch.randn(B, G, T, d, generator=gen)
    gout, glse = torch.randn(B, H, T, d, generator=gen), torch.randn(B, H, T, generator=gen)
    dtype = case.get("dtype", torch.float32)
    q, k, v = (x.to(dtype) for x in (q, k, v))  # the reference sees the same (rounded) values in fp32
    scale = d ** -0.5

    layout = RingLayout(P, rank, T, case["kind"])
    ql, kl, vl = (layout.shard(x, 2).requires_grad_() for x in (q, k, v))
    STATS.reset()
    out, lse = ring_attention(ql, kl, vl, scale=scale, layout=layout, group=group, spec=spec,
                              block_q=block, block_k=block, return_lse=True)
    fwd_bytes = STATS.forward_bytes
    grads = torch.autograd.grad((out, lse), (ql, kl, vl), (layout.shard(gout, 2).to(dtype), layout.shard(glse, 2)))
    res = {"dtypes": [str(t.dtype) for t in (out, *grads)]}
    res.update(fwd_bytes=fwd_bytes, bwd_bytes=STATS.backward_bytes)
    pad = ~layout.real()
    res["pad_out"] = out[:, :, pad].abs().max().item() if pad.any() else 0.0
    res["pad_lse_dead"] = bool((lse[:, :, pad] == float("-inf")).all())
    full = [layout.gather(t, 2, group) for t in (out, lse, *grads)]  # global order, pad dropped
    if layout.rank != 0:
        return res

    q, k, v = (x.float().requires_grad_() for x in (q, k, v))
    pos = torch.arange(T)
    ref, ref_lse = eager_reference(q, k, v, scale, spec.mask(pos, pos)[None, None])
    dead = ref_lse == float("-inf")
    ref_grads = torch.autograd.grad((ref, ref_lse), (q, k, v), (gout, glse.masked_fill(dead, 0.0)))
    res["out"] = _max_err(full[0], ref)
    res["lse"] = _max_err(full[1][~dead], ref_lse[~dead]) if (~dead).any() else 0.0
    res["lse_dead_match"] = bool(torch.equal(full[1] == float("-inf"), dead))
    for name, g, r in zip(("dq", "dk", "dv"), full[2:], ref_grads):
        res[name] = _max_err(g, r)
    return res


def attention_cases(rank: int, world: int, cases: dict) -> dict:
    return {name: _one_case(rank, world, case) for name, case in cases.items()}


def error_checks(rank: int, world: int, payload) -> dict:
    """Mismatched layouts are refused with one-line messages on every rank (nothing hangs)."""
    from gqakit.attention.masks import AttentionOptionError
    from gqakit.attention.ring import RingLayout, ring_attention, ring_context

    msgs = {}
    q, k = torch.randn(1, 2, 8, 4), torch.randn(1, 1, 8, 4)
    for name, layout in {"size": RingLayout(world * 2, rank, 32), "rank": RingLayout(world, (rank + 1) % world, 16),
                         "length": RingLayout(world, rank, 60)}.items():
        try:
            ring_attention(q, k, k, scale=0.5, layout=layout)
            msgs[name] = None
        except AttentionOptionError as e:
            msgs[name] = str(e)
    try:
        with ring_context(RingLayout(world * 2, rank, 32)):
            pass
        msgs["context"] = None
    except AttentionOptionError as e:
        msgs["context"] = str(e)
    return msgs


def subgroup_cases(rank: int, world: int, cases: dict) -> dict:
    """Rings of 2 inside a world of 4 (ring_groups): ring ranks map to global ranks correctly."""
    from gqakit.attention.ring import ring_groups

    groups = ring_groups(2)
    out = {}
    for name, case in cases.items():
        case = dict(case, seed=case.get("seed", 0) + groups.data_rank)  # each ring sees different data
        out[name] = _one_case(groups.ring_rank, 2, case, group=groups.ring)
    out["_groups"] = (groups.ring_rank, groups.data_rank)
    return out


# ---- a tiny Llama under gqakit_ring vs the single-process model --------------------------------------

def llama_ring(rank: int, world: int, payload: dict) -> dict:
    """Per layout kind: |loss - ref|, max |logits - ref| on the local real tokens, max |grad - ref|."""
    return {kind: _llama_case(rank, world, payload["path"], payload["T"], kind) for kind in payload["kinds"]}


def _llama_case(rank: int, world: int, path: str, T: int, kind: str) -> dict:
    from transformers import AutoModelForCausalLM

    from gqakit.attention.masks import MaskSpec
    from gqakit.attention.ring import STATS, RingLayout, ring_batch, ring_context

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (2, T), generator=gen)
    labels = ids.clone()
    labels[1, :5] = -100  # some ignored targets: the global token count must still be right

    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    ref_out = ref(input_ids=ids, labels=labels)
    ref_out.loss.backward()

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="gqakit_ring")
    layout = RingLayout(world, rank, T, kind)
    batch = ring_batch(layout, ids, labels)
    STATS.reset()
    with ring_context(layout, spec=MaskSpec(), block_q=8, block_k=8):
        out = model(**batch)
    out.loss.backward()
    sent = STATS.forward_bytes  # > 0: the layers really went round the ring
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)  # each rank's loss is its share of the global mean
    for p in model.parameters():  # context parallel: parameter gradients SUM over the ring
        dist.all_reduce(p.grad)

    real = layout.real()
    ref_local = layout.shard(ref_out.logits.detach(), 1)
    grad_err = max(_max_err(p.grad, r.grad) for p, r in zip(model.parameters(), ref.parameters()))
    return {"loss": abs(loss.item() - ref_out.loss.item()), "logits": _max_err(out.logits[:, real], ref_local[:, real]),
            "grads": grad_err, "grad_scale": max(r.grad.abs().max().item() for r in ref.parameters()),
            "loss_value": ref_out.loss.item(), "sent": sent}

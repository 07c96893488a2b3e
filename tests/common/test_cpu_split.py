"""Work dealt over one-thread Python threads (`common/cpu_split.py`), and the tiled kernel that uses it.

* `deal` gives every index once, balances the cost (largest first onto the least loaded), and depends on the
  costs only;
* tiled attention (small shapes dealt all the same), forward and backward, on 1, 2 and 3 threads equals the
  eager reference (fp32, 1e-5 as in test_tiled.py) and the 1-thread run (1e-6: only the order of dK / dV's
  partial sums differs), and repeated calls on the same number of threads give the same bits; calls under
  SPLIT_MIN_SCORES and single query blocks (decode) stay on the calling thread;
* the small-call path (every op on the calling thread, at one thread) gives the same output and dQ bits as the
  same call dealt over 2 threads, and dK / dV within 1e-6; the kernel's own ops never run on more than one
  thread, forward or backward, and the caller's thread setting is back afterwards;
* a decode step over a large cache deals its keys over the workers (contiguous runs of about equal keys), and
  the shares merged by log-sum-exp equal the reference (output, lse, gradients; with sinks, a window, padding)
  and the one-thread run within 1e-6, with the same bits on every call;
* torch's thread setting is the caller's afterwards, also for threads started later; an error in a part is
  raised in the caller; grad mode is the caller's; a pool thread does not split again; inside
  `one_thread_here` ops run on one thread while `split_count` still says the caller's count.
"""
from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from gqakit.common import cpu_split
from gqakit.attention.masks import MaskSpec
from gqakit.attention.reference import eager_reference
from gqakit.attention import tiled
from gqakit.attention.tiled import tiled_attention


@contextlib.contextmanager
def threads(n: int):
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def test_deal_balances_and_depends_on_costs_only():
    costs = [1, 2, 3, 4, 5, 6, 7, 8]  # a causal query-block ramp
    parts = cpu_split.deal(costs, 2)
    assert sorted(i for part in parts for i in part) == list(range(8))
    assert [sum(costs[i] for i in part) for part in parts] == [18, 18]
    assert all(part == sorted(part) for part in parts)
    assert cpu_split.deal(costs, 2) == parts
    assert cpu_split.deal([5], 4) == [[0]]  # parts with nothing are dropped
    assert cpu_split.deal([], 3) == []
    loads = [sum(costs[i] for i in p) for p in cpu_split.deal(costs, 3)]
    assert loads == [13, 12, 11]  # largest first onto the least loaded: 8+3+2, 7+4+1, 6+5


def _case(spec: MaskSpec, T: int, seed: int):
    """q (2, 4, T, 16) on 2 K/V heads, k, v (grads required), and the eager reference's output and grads."""
    gen = torch.Generator().manual_seed(seed)
    B, H, G, d = 2, 4, 2, 16
    q = torch.randn(B, H, T, d, generator=gen).requires_grad_()
    k = torch.randn(B, G, T, d, generator=gen).requires_grad_()
    v = torch.randn(B, G, T, d, generator=gen).requires_grad_()
    allowed = spec.mask(torch.arange(T), torch.arange(T))[None, None]
    ref = eager_reference(q, k, v, 0.125, allowed)[0]
    return q, k, v, ref.detach(), torch.autograd.grad(ref.pow(2).sum(), (q, k, v))


def _run(q, k, v, spec, block):
    out = tiled_attention(q, k, v, scale=0.125, spec=spec, block_q=block, block_k=block)
    grads = torch.autograd.grad(out.pow(2).sum(), (q, k, v))
    return out.detach(), grads


@pytest.mark.parametrize("spec", [MaskSpec(), MaskSpec(window=40), MaskSpec(causal=False)])
def test_split_kernel_equals_reference_and_one_thread(spec, monkeypatch):
    monkeypatch.setattr(tiled, "SPLIT_MIN_SCORES", 0)  # small shapes: dealt over threads all the same
    q, k, v, ref, ref_grads = _case(spec, 200, seed=0)
    B, H = q.shape[:2]
    with threads(1):
        one, one_grads = _run(q, k, v, spec, 32)
    for n in (2, 3):
        with threads(n):
            assert len(cpu_split.deal([1] * 7, cpu_split.split_count(q.device))) == n
            assert len(tiled._make_tiles(q, k, v, spec, 0, 0, None, None, 32, 32).parts(n, B * H)) == n
            out, grads = _run(q, k, v, spec, 32)
            again, again_grads = _run(q, k, v, spec, 32)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out, one, atol=1e-6, rtol=1e-6)
        assert torch.equal(out, again)
        for g, g_ref, g_one, g_again in zip(grads, ref_grads, one_grads, again_grads):
            torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(g, g_one, atol=1e-6, rtol=1e-6)
            assert torch.equal(g, g_again)


def test_small_calls_stay_on_the_calling_thread():
    q = k = v = torch.zeros(1, 1, 256, 64)
    tiles = tiled._make_tiles(q, k, v, MaskSpec(), 0, 0, None, None, 128, 128)
    assert len(tiles.parts(2, 1)) == 1  # 49k scores: below SPLIT_MIN_SCORES
    q = k = v = torch.zeros(1, 8, 256, 64)
    tiles = tiled._make_tiles(q, k, v, MaskSpec(), 0, 0, None, None, 128, 128)
    assert len(tiles.parts(2, 8)) == 2  # 393k: two query blocks, dealt
    q, k = torch.zeros(1, 8, 1, 64), torch.zeros(1, 8, 16384, 64)  # decode: one query block, 131k scores
    tiles = tiled._make_tiles(q, k, k, MaskSpec(), 16383, 0, None, None, 128, 128)
    assert len(tiles.parts(2, 8)) == 1


def _traced_call(q, k, v, spec, block, q_offset=0):
    """Output and grads of a call, and every (thread name, torch threads) seen where the kernel masks a tile."""
    seen = set()

    def extra(b, h, qi, ki):  # runs inside the kernel's block loop: says which thread, with how many threads
        seen.add((threading.current_thread().name.split("_")[0], torch.get_num_threads()))
        return torch.ones((), dtype=torch.bool)

    out = tiled_attention(q, k, v, scale=0.125, spec=spec, block_q=block, block_k=block, extra_mask=extra,
                          q_offset=q_offset)
    grads = torch.autograd.grad(out.pow(2).sum(), (q, k, v))
    return out.detach(), grads, seen


@pytest.mark.parametrize("spec", [MaskSpec(), MaskSpec(window=40)])
def test_one_thread_small_path_equals_the_dealt_path(spec, monkeypatch):
    q, k, v, ref, ref_grads = _case(spec, 160, seed=1)
    with threads(2):
        monkeypatch.setattr(tiled, "SPLIT_MIN_SCORES", 10**12)  # the small-call path
        small, small_grads, small_seen = _traced_call(q, k, v, spec, 32)
        assert torch.get_num_threads() == 2
        monkeypatch.setattr(tiled, "SPLIT_MIN_SCORES", 0)  # the same call dealt over 2 one-thread workers
        dealt, dealt_grads, dealt_seen = _traced_call(q, k, v, spec, 32)
        assert torch.get_num_threads() == 2
    assert small_seen == {("MainThread", 1)}  # on the caller, at one thread
    assert {n for n, _ in dealt_seen} == {"gqakit-split"} and {t for _, t in dealt_seen} == {1}
    torch.testing.assert_close(small, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(small, dealt)  # each query block's ops are the same one-thread ops on either path
    assert torch.equal(small_grads[0], dealt_grads[0])  # dQ: rows of its own query blocks
    for g, g_dealt, g_ref in zip(small_grads[1:], dealt_grads[1:], ref_grads[1:]):
        torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(g, g_dealt, atol=1e-6, rtol=1e-6)  # dK / dV: partial sums in another order
    torch.testing.assert_close(small_grads[0], ref_grads[0], atol=1e-5, rtol=1e-5)


def test_decode_runs_on_the_calling_thread_and_matches_the_reference():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 1, 16, generator=gen)
    k, v = torch.randn(2, 1, 2, 300, 16, generator=gen)
    allowed = torch.ones(1, 1, 1, 300, dtype=torch.bool)
    ref = eager_reference(q, k, v, 0.125, allowed)[0]
    with threads(2):
        out, _, seen = _traced_call(q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), MaskSpec(), 64,
                                    q_offset=299)  # the newest token, after a 299-token cache
        assert torch.get_num_threads() == 2
    assert seen == {("MainThread", 1)}
    torch.testing.assert_close(out, ref.detach(), atol=1e-5, rtol=1e-5)


def test_thread_setting_grad_mode_errors_and_nesting():
    with threads(2):
        seen = []

        def part(ids):
            seen.append((ids, torch.is_grad_enabled(), cpu_split.split_count(torch.device("cpu")),
                         torch.get_num_threads()))
            return sum(ids)

        with torch.no_grad():
            assert cpu_split.run_split(part, [[0, 1], [2]]) == [1, 2]
        assert sorted(seen) == [([0, 1], False, 1, 1), ([2], False, 1, 1)]  # one thread each, no nesting
        assert torch.get_num_threads() == 2
        later = []
        t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert later == [2]  # the pool threads' own setting did not become the default

        def failing(ids):
            if ids == [1]:
                raise ValueError("part 1 failed")
            return 0

        with pytest.raises(ValueError, match="part 1 failed"):
            cpu_split.run_split(failing, [[0], [1]])
        assert torch.get_num_threads() == 2
    assert cpu_split.split_count(torch.device("meta")) == 1


def test_decode_key_runs_are_contiguous_and_balanced():
    q, k = torch.zeros(1, 8, 1, 64), torch.zeros(1, 8, 16384, 64)
    tiles = tiled._make_tiles(q, k, k, MaskSpec(), 16383, 0, None, None, 128, 128)
    runs = tiles.key_runs(2, 8 * 128 * 4)  # 64 MiB of K/V: dealt
    assert [(run[0][0], run[-1][1]) for run in runs] == [(0, 8192), (8192, 16384)]
    assert all(k1 - k0 <= tiled.SPAN_K for run in runs for k0, k1, _ in run)  # fused as `steps` are
    assert len(tiles.key_runs(3, 8 * 128 * 4)) == 3
    assert tiles.key_runs(1, 8 * 128 * 4) is None and tiles.key_runs(2, 8 * 128) is None  # one worker; 16 MiB
    q = torch.zeros(1, 8, 256, 64)  # two query blocks: dealt by query block
    assert tiled._make_tiles(q, k, k, MaskSpec(), 16128, 0, None, None, 128, 128).key_runs(2, 10**9) is None


@pytest.mark.parametrize("case", ["plain", "sinks", "window and padding"])
def test_decode_keys_dealt_equal_the_reference_and_one_thread(case, monkeypatch):
    monkeypatch.setattr(tiled, "SPLIT_MIN_KV_BYTES", 0)  # a small cache, dealt all the same
    gen = torch.Generator().manual_seed(3)
    B, H, G, N, d = 2, 4, 2, 300, 16
    q = torch.randn(B, H, 1, d, generator=gen).requires_grad_()
    k = torch.randn(B, G, N, d, generator=gen).requires_grad_()
    v = torch.randn(B, G, N, d, generator=gen).requires_grad_()
    s_aux = torch.randn(H, generator=gen).requires_grad_() if case == "sinks" else None
    spec = MaskSpec(window=100) if case == "window and padding" else MaskSpec()
    padding = torch.ones(B, N, dtype=torch.bool)
    if case == "window and padding":
        padding[0, 210:240] = False
    allowed = spec.mask(torch.arange(N - 1, N), torch.arange(N))[None, None] & padding[:, None, None, :]
    ref, ref_lse = eager_reference(q, k, v, 0.125, allowed, s_aux=s_aux)
    inputs = (q, k, v) if s_aux is None else (q, k, v, s_aux)
    ref_grads = torch.autograd.grad(ref.pow(2).sum() + ref_lse.sum(), inputs)

    def call():
        out, lse = tiled_attention(q, k, v, scale=0.125, spec=spec, q_offset=N - 1, key_padding=padding, s_aux=s_aux,
                                   block_q=32, block_k=32, return_lse=True)
        grads = torch.autograd.grad(out.pow(2).sum() + lse.sum(), inputs)
        return [out.detach(), lse.detach(), *grads]

    with threads(1):
        one = call()
    for n in (2, 3):
        with threads(n):
            tiles = tiled._make_tiles(q, k, v, spec, N - 1, 0, padding, None, 32, 32)
            assert len(tiles.key_runs(n, 1)) == n
            got, again = call(), call()
        for x, x_ref, x_one, x_again in zip(got, [ref.detach(), ref_lse.detach(), *ref_grads], one, again):
            torch.testing.assert_close(x, x_ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(x, x_one, atol=1e-6, rtol=1e-6)
            assert torch.equal(x, x_again)


def test_one_thread_here_keeps_the_callers_count_for_the_deal():
    with threads(2):
        with cpu_split.one_thread_here(torch.device("cpu")):
            assert torch.get_num_threads() == 1
            assert cpu_split.split_count(torch.device("cpu")) == 2
            with cpu_split.one_thread_here(torch.device("cpu")):  # nested: left as it is
                assert cpu_split.split_count(torch.device("cpu")) == 2
            assert torch.get_num_threads() == 1
            assert cpu_split.run_split(lambda ids: (sum(ids), torch.get_num_threads()), [[1], [2]]) == [(1, 1), (2, 1)]
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2 and cpu_split.split_count(torch.device("cpu")) == 2
        with pytest.raises(RuntimeError, match="inside"):
            with cpu_split.one_thread_here(torch.device("cpu")):
                raise RuntimeError("inside")
        assert torch.get_num_threads() == 2
        later = []
        t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert later == [2]


def test_a_forked_child_starts_its_own_pool():
    import os
    import signal

    with threads(2):
        slow = lambda ids: time.sleep(0.2) or sum(ids)  # noqa: E731  (slow parts: the pool starts both threads)
        assert cpu_split.run_split(slow, [[1], [2]]) == [1, 2]
        time.sleep(0.5)  # both threads idle: a child using this pool would wait for them forever
        pid = os.fork()
        if pid == 0:  # the child: the parent's pool threads are not here
            ok = False
            try:
                signal.alarm(60)  # a hang ends the child by SIGALRM, a failure the parent sees
                ok = cpu_split.run_split(lambda ids: sum(ids), [[3], [4]]) == [3, 4]
            finally:
                os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0

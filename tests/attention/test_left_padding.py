"""Patterns anchored at positions (sinks, global tokens, chunks, the fixed pattern's summary columns) on left-padded
batches: a row's leading pads shift its tokens' positions (`row_shift`), so the anchors count from the row's first
real token, and every row gets what it gets alone.

References: the kernels against `eager_reference` in float64 with a dense mask built entry by entry from each row's
positions (fp32 tolerances as in test_attention_features: 1e-5 out, 1e-4 gradients); whole tiny models against the
same rows run one at a time, unpadded (fp32, 1e-5).
"""
from __future__ import annotations

import pytest
import torch
import transformers

from gqakit.attention import use
from gqakit.attention.flex import flex_attention_forward
from gqakit.attention.masks import MaskSpec
from gqakit.attention.patterns import fixed
from gqakit.attention.reference import eager_reference
from gqakit.attention.tiled import tiled_attention
from gqakit.common.errors import GqakitError

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

SPECS = {
    "sinks": MaskSpec(window=5, sinks=2),
    "globals": MaskSpec(window=4, global_tokens=(0, 9)),
    "globals, encoder": MaskSpec(causal=False, window=3, global_tokens=(1,)),
    "chunk": MaskSpec(chunk=6),
    "dilated sinks": MaskSpec(window=9, dilation=2, sinks=1),
    "fixed": fixed(4, 1),
}


def shifted_mask(spec, shift, key_padding, Tq, q_offset, H=1):
    """(B, H|1, Tq, Tk) bool, one entry at a time: row b's query i and key j at positions q_offset + i - shift[b] and
    j - shift[b]; pads (key_padding False) never attended."""
    B, Tk = key_padding.shape
    specs = spec if isinstance(spec, tuple) else (spec,)
    mask = torch.zeros(B, len(specs), Tq, Tk, dtype=torch.bool)
    for b in range(B):
        for h, one in enumerate(specs):
            for i in range(Tq):
                for j in range(Tk):
                    q, k = torch.tensor(q_offset + i - int(shift[b])), torch.tensor(j - int(shift[b]))
                    mask[b, h, i, j] = bool(one.allowed(q, k)) and bool(key_padding[b, j])
    return mask


def _batch(B=4, H=4, G=2, Tq=27, Tk=27, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Tq, d, generator=gen, requires_grad=True)
    k = torch.randn(B, G, Tk, d, generator=gen, requires_grad=True)
    v = torch.randn(B, G, Tk, d, generator=gen, requires_grad=True)
    shift = torch.tensor([0, 3, 11, 26])[:B]  # unpadded, a few pads, many, all but one token
    padding = torch.arange(Tk)[None, :] >= shift[:, None]
    return q, k, v, shift, padding


def _err(a, b):
    return float((a.detach().double() - b.detach().double()).abs().max())


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("block", [4, 16])
def test_tiled_kernel_places_anchors_per_row(name, block):
    spec = SPECS[name]
    q, k, v, shift, padding = _batch()
    out = tiled_attention(q, k, v, scale=0.4, spec=spec, key_padding=padding, row_shift=shift, block_q=block,
                          block_k=block)
    ref, _ = eager_reference(*(t.detach().double().requires_grad_() for t in (q, k, v)), 0.4,
                             shifted_mask(spec, shift, padding, q.shape[2], 0))
    assert _err(out, ref) < 1e-5
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(out.shape, generator=gen)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = eager_reference(*leaves, 0.4, shifted_mask(spec, shift, padding, q.shape[2], 0))
    for got, want in zip(torch.autograd.grad((out * g).sum(), (q, k, v)),
                         torch.autograd.grad((ref * g.double()).sum(), leaves)):
        assert _err(got, want) < 1e-4
    unshifted = tiled_attention(q, k, v, scale=0.4, spec=spec, key_padding=padding, block_q=block, block_k=block)
    assert _err(unshifted, out) > 1e-2  # the shift matters for this pattern


def test_per_head_patterns_and_a_decode_offset_are_shifted_too():
    """One spec per query head, and queries at the end of a longer cache (q_offset > 0, as a decode step)."""
    spec = (SPECS["sinks"], MaskSpec(), SPECS["globals"], MaskSpec(window=3))
    q, k, v, shift, padding = _batch(Tq=5)
    with torch.no_grad():
        out = tiled_attention(q, k, v, scale=0.4, spec=spec, q_offset=22, key_padding=padding, row_shift=shift,
                              block_q=2, block_k=4)
        ref, _ = eager_reference(q.double(), k.double(), v.double(), 0.4, shifted_mask(spec, shift, padding, 5, 22))
    assert _err(out, ref) < 1e-5


@pytest.mark.parametrize("name", ["sinks", "globals", "fixed"])
def test_flex_places_anchors_per_row_as_the_tiled_kernel(name):
    """Eager flex_attention on CPU (forward only there) against the dense reference."""
    spec = SPECS[name]
    q, k, v, shift, padding = _batch()
    q, k, v = (t.detach() for t in (q, k, v))  # flex has no backward on CPU
    with torch.no_grad():
        out = flex_attention_forward(q, k, v, scale=0.4, spec=spec, key_padding=padding, row_shift=shift,
                                     block_size=8)
        ref, _ = eager_reference(q.double(), k.double(), v.double(), 0.4,
                                 shifted_mask(spec, shift, padding, q.shape[2], 0))
    assert _err(out, ref) < 1e-5


def test_a_row_shift_that_is_not_leading_pads_is_refused():
    q, k, v, shift, padding = _batch()
    for bad in (shift[:3], shift.float(), -shift):
        with pytest.raises(ValueError, match=r"row_shift has shape .*; expected one integer >= 0 per batch row"):
            tiled_attention(q, k, v, scale=0.4, spec=SPECS["sinks"], key_padding=padding, row_shift=bad)


TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, eos_token_id=None)  # no early stop


@pytest.mark.parametrize("kind, options", [
    ("sinks", dict(sinks=2, window=4)),
    ("sliding", dict(window=4, global_tokens=[0, 2])),
    ("sparse", dict(pattern="fixed", stride=4, summary=1)),
])
def test_a_left_padded_batch_gives_each_row_what_it_gives_alone(kind, options):
    """Logits of a left-padded batch (positions from the mask, as generate() numbers them) against each row run
    alone without its pads; then greedy generation, batched against one row at a time."""
    torch.manual_seed(0)
    model = use(transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY)).eval(), kind,
                **options)
    ids = torch.randint(3, 64, (3, 14), generator=torch.Generator().manual_seed(1))
    pads = [0, 5, 9]
    mask = (torch.arange(14)[None, :] >= torch.tensor(pads)[:, None]).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        for row, p in enumerate(pads):
            alone = model(input_ids=ids[row:row + 1, p:]).logits[0]
            torch.testing.assert_close(batch[row, p:], alone, atol=1e-5, rtol=1e-5)
    if kind == "sinks":
        return  # its generate() runs over a SinkCache, which takes left padding itself (tests/decode)
    run = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    got = model.generate(ids, attention_mask=mask, **run)
    for row, p in enumerate(pads):
        want = model.generate(ids[row:row + 1, p:], **run)
        assert torch.equal(got.sequences[row, 14:], want.sequences[0, 14 - p:])
        torch.testing.assert_close(torch.stack(got.scores)[:, row], torch.stack(want.scores)[:, 0], atol=1e-4,
                                   rtol=1e-4)


def test_rows_with_padding_between_their_tokens_are_refused_with_anchored_patterns():
    """No one shift gives such a row's positions: refused in one line; distance-only patterns run."""
    cfg = transformers.LlamaConfig(**TINY)
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    gapped = torch.ones(2, 12, dtype=torch.long)
    gapped[1, 4:6] = 0
    model = use(transformers.AutoModelForCausalLM.from_config(cfg).eval(), "sinks", sinks=2, window=4)
    with torch.no_grad(), pytest.raises(GqakitError, match="padding between its tokens.*pad on the left or the right"):
        model(input_ids=ids, attention_mask=gapped)
    model = use(transformers.AutoModelForCausalLM.from_config(cfg).eval(), "sliding", window=4, dilation=2)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids, attention_mask=gapped).logits).all()


@pytest.mark.parametrize("kind, options", [("sinks", dict(sinks=2, window=4)),
                                           ("sliding", dict(window=7, dilation=2, global_tokens=[0, 3])),
                                           ("sparse", dict(pattern="fixed", stride=4, summary=2))])
def test_documents_packed_into_a_row_are_refused_with_anchored_patterns(kind, options):
    """Packed documents (position_ids restarting, or cu_seq_lens) restart their positions mid-row, where sinks, global
    tokens and fixed blocks would still sit at the row's start: a review measured documents 2 and 3 0.08-0.17 off
    their logits alone. Refused in one line; distance-only patterns equal the documents run alone."""
    cfg = transformers.LlamaConfig(**TINY)
    lengths = (7, 5, 7)
    ids = torch.randint(3, 64, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 7, 12, 19], dtype=torch.int32)
    model = use(transformers.AutoModelForCausalLM.from_config(cfg).eval(), kind, **options)
    for extra in ({}, dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)):
        with torch.no_grad(), pytest.raises(GqakitError, match="packs documents into a row.*a row of its own"):
            model(input_ids=ids, position_ids=positions, use_cache=False, **extra)
    model = use(transformers.AutoModelForCausalLM.from_config(cfg).eval(), "sliding", window=4, dilation=2)
    with torch.no_grad():
        alone = torch.cat([model(input_ids=ids[:, a:a + n]).logits for a, n in zip((0, 7, 12), lengths)], dim=1)
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", [MaskSpec(dilation=5), MaskSpec(causal=False, sinks=1, window=2), SPECS["sinks"],
                                  SPECS["fixed"], SPECS["chunk"]], ids=["dilation", "sink-encoder", "sinks", "fixed",
                                                                         "chunk"])
def test_keys_before_a_rows_start_are_planned_exactly_without_key_padding(spec):
    """Called directly with a shift and no key padding, the keys before a row's start sit at negative positions:
    they are no sinks (0 <= k < sinks), and the block planner neither skips them where the rule allows them nor
    calls a block of them full where it does not (a review found 0.3-3.4 off here: `_full` took a block at
    k <= 0 as sinks with sinks=0, `_spans` left out allowed negative keys)."""
    assert not MaskSpec(dilation=5).block_is_full(-1, 2, -1, 0)
    q, k, v, shift, _ = _batch(Tq=12, Tk=12)
    shift = torch.tensor([0, 6, 3, 11])
    everything = torch.ones(4, 12, dtype=torch.bool)
    with torch.no_grad():
        for block in (1, 3, 4):
            out = tiled_attention(q, k, v, scale=0.4, spec=spec, row_shift=shift, block_q=block, block_k=block)
            ref, _ = eager_reference(q.double(), k.double(), v.double(), 0.4,
                                     shifted_mask(spec, shift, everything, 12, 0))
            assert _err(out, ref) < 1e-5, block


def test_a_callers_4d_mask_that_hides_a_rows_start_is_refused_with_anchored_patterns():
    """A 4-D mask reaches the kernel as a tensor, which says nothing of where a row's tokens start: with a row's
    first column hidden from every query (left padding) anchored patterns are refused, not placed on its pads
    (0.07-0.21 logits off before); an unpadded 4-D mask runs."""
    model = use(transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY)).eval(), "sinks",
                sinks=2, window=4)
    ids = torch.randint(3, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    padded = causal[None, None].repeat(2, 1, 1, 1)
    padded[1, :, :, :3] = False
    with torch.no_grad():
        with pytest.raises(GqakitError, match="hides a row's first column from every query.*pass a 2-D attention_mask"):
            model(input_ids=ids, attention_mask=padded)
        full = model(input_ids=ids, attention_mask=causal[None, None].repeat(2, 1, 1, 1)).logits
        torch.testing.assert_close(full, model(input_ids=ids).logits, atol=1e-5, rtol=1e-5)

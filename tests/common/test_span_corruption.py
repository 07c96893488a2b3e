"""T5 span corruption: the corrupted pair always rebuilds the window, has the lengths T5's rule gives, and is a
function of the window and the seed alone."""
from __future__ import annotations

import pytest
import torch

from gqakit.common.errors import GqakitError
from gqakit.common.span_corruption import corrupt, corrupt_rows, corrupted_lengths, sentinel_ids, span_counts

SENTINELS = list(range(1000, 1100))  # ids far from the window's tokens
EOS = 1


def rebuild(inputs: torch.Tensor, targets: torch.Tensor) -> tuple[list[int], int]:
    """The window from its corruption: each sentinel of the input replaced by the span after it in the target."""
    spans, current, marker = {}, None, None
    for t in targets.tolist()[:-1]:
        if t in SENTINELS:
            marker = t
            spans[marker] = current = []
        else:
            current.append(t)
    out = []
    for t in inputs.tolist()[:-1]:
        out += spans[t] if t in SENTINELS else [t]
    return out, len(spans)


@pytest.mark.parametrize("length", [2, 3, 10, 64, 511, 512])
def test_corruption_rebuilds_the_window_with_t5_lengths(length):
    window = torch.arange(10, 10 + length)
    for seed in range(5):
        inputs, targets = corrupt(window, SENTINELS, EOS, torch.Generator().manual_seed(seed))
        assert inputs[-1] == EOS and targets[-1] == EOS
        assert (inputs.numel(), targets.numel()) == corrupted_lengths(length)
        rebuilt, spans = rebuild(inputs, targets)
        assert rebuilt == window.tolist()
        noise, want_spans = span_counts(length)
        assert spans == want_spans
        assert targets.numel() - spans - 1 == noise
        assert inputs[0] not in SENTINELS  # non-noise first


def test_t5_rule():
    assert span_counts(512) == (77, 26)  # round(512 * 0.15) = 77 noise tokens, round(77 / 3) = 26 spans
    assert corrupted_lengths(512) == (512 - 77 + 26 + 1, 77 + 26 + 1)
    assert span_counts(2) == (1, 1)


def test_rows_are_corrupted_by_their_content_and_the_seed():
    rows = torch.randint(10, 900, (4, 64), generator=torch.Generator().manual_seed(0))
    a = corrupt_rows(rows, SENTINELS, EOS, seed=0)
    b = corrupt_rows(rows.flip(0), SENTINELS, EOS, seed=0)  # another order, another batch: the same masks
    assert torch.equal(a[0], b[0].flip(0)) and torch.equal(a[1], b[1].flip(0))
    c = corrupt_rows(rows, SENTINELS, EOS, seed=1)
    assert not torch.equal(a[0], c[0])
    masks = {tuple(x.tolist()) for x in a[1]}
    assert len(masks) == 4


def test_too_few_sentinels_and_none_are_one_line():
    with pytest.raises(GqakitError, match="sentinel tokens; use shorter windows"):
        corrupt(torch.arange(10, 522), SENTINELS[:3], EOS, torch.Generator().manual_seed(0))

    class Vocab:
        def __init__(self, tokens):
            self.tokens = tokens

        def get_vocab(self):
            return self.tokens
    assert sentinel_ids(Vocab({"<extra_id_1>": 7, "<extra_id_0>": 9, "<extra_id_3>": 2, "a": 0})) == [9, 7]
    with pytest.raises(GqakitError, match="no <extra_id_0>"):
        sentinel_ids(Vocab({"a": 0}))

"""benchmarks/_measure.py's summaries of timed steps."""
from __future__ import annotations

from pathlib import Path


def test_p90_is_the_90th_percentile_not_a_lower_sample(monkeypatch):
    """Of 16 steps, the 90th percentile lies between the 14th and 15th fastest (position 0.9 x 15 = 13.5 from 0);
    the lower sample at int(0.9 x 15) = 13 was the 0.87 quantile that the tables called p90."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from _measure import median_p90

    assert median_p90([float(i) for i in range(16, 0, -1)]) == (8.5, 14.5)
    assert median_p90([2.0, 1.0]) == (1.5, 1.9) and median_p90([3.0]) == (3.0, 3.0)

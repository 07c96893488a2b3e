"""The GPU device check's tests (`pytest -m cuda tests/cuda`). Their CUDA cases carry the `cuda` marker and skip
without CUDA (tests/support/devices.py); their CPU cases run in the normal suite.

GQAKIT_TEST_DEADLINE (seconds since the epoch, set by benchmarks/gpu/run.sh) skips every test that would start
after it, so that a run cut short by its time budget still ends with a full report of what ran."""
import os
import time

import pytest


DEADLINE_SKIP = "the device check's time budget for the tests is spent"  # benchmarks/gpu/summary.py counts these


def pytest_runtest_setup(item):
    deadline = os.environ.get("GQAKIT_TEST_DEADLINE")
    if deadline and time.time() > float(deadline):
        pytest.skip(DEADLINE_SKIP)


@pytest.fixture(autouse=True, scope="session")
def many_compiles():
    """Each mask pattern, dtype and shape compiles flex_attention anew; past dynamo's recompile limit (8) it would
    fall back to eager flex silently, and the compiled kernels would go untested."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    before = getattr(config, name)
    setattr(config, name, 256)
    yield
    setattr(config, name, before)

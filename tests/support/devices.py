"""The devices a test body runs on: CPU in the normal suite, CUDA under the `cuda` marker (`pytest -m cuda`), which
skips at once where there is no CUDA device. A test parametrised with DEVICES proves its logic on CPU here and runs
the same body on the GPU in the device check (benchmarks/gpu/run.sh)."""
from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")],
                    id="cuda")
DEVICES = [pytest.param("cpu", id="cpu"), CUDA]

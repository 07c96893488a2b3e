"""Suite-wide settings. Tests mirror the packages (tests/convert/, tests/uptrain/, ...); their shared helpers are
in tests/support/ and the scripts that multi-process tests start are in tests/workers/, both importable by name."""
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
for folder in ("support", "workers"):
    if str(TESTS / folder) not in sys.path:
        sys.path.insert(0, str(TESTS / folder))


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny models run several times faster on one thread than on two contended ones; restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def token_cache_root(tmp_path_factory):
    """Implicit token caches (gqakit uptrain's data) go to a temporary folder, never ~/.cache; worker
    processes that the tests start inherit the variable."""
    import os

    before = os.environ.get("GQAKIT_CACHE_DIR")
    os.environ["GQAKIT_CACHE_DIR"] = str(tmp_path_factory.mktemp("token-caches"))
    yield
    if before is None:
        os.environ.pop("GQAKIT_CACHE_DIR", None)
    else:
        os.environ["GQAKIT_CACHE_DIR"] = before


# The longest test (it runs every documented command) goes first: when the suite runs in parallel processes
# (pytest -n 2 --dist worksteal, the README's command), the other worker takes the rest around it instead of
# one worker finishing it alone at the end. The GPU check's longest tests (torchrun launches, conversions) go
# first too: collected last, they started nearest its deadline (they skip at once without CUDA).
FIRST = ("tests/test_readme_commands.py::test_every_readme_command_runs", "tests/cuda/test_cuda_uptrain.py",
         "tests/cuda/test_cuda_convert_decode.py")


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:  # FIRST's order, then every other test in its place (a stable sort)
        return next((i for i, prefix in enumerate(FIRST) if item.nodeid.startswith(prefix)), len(FIRST))

    items.sort(key=rank)

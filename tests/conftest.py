"""Suite-wide settings."""
import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny models run several times faster on one thread than on two contended ones; restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

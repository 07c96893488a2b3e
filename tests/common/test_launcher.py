"""torchrun's environment read one way: unset or empty is a process on its own."""
import pytest

from gqakit.common import launcher

VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.mark.parametrize("given", [None, ""])
def test_unset_or_empty_is_one_process(monkeypatch, given):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False) if given is None else monkeypatch.setenv(name, given)
    assert (launcher.rank(), launcher.world_size(), launcher.local_rank(), launcher.local_world_size()) == (0, 1, 0, 1)


def test_a_launched_process(monkeypatch):
    for name, value in zip(VARIABLES, ("5", "8", "1", "4")):
        monkeypatch.setenv(name, value)
    assert (launcher.rank(), launcher.world_size(), launcher.local_rank(), launcher.local_world_size()) == (5, 8, 1, 4)

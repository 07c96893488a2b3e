"""A model or tokenizer name that is not a local folder is refused at once, in one line, where the hub cannot
serve it (gqakit.hf.hub); never half a minute of retries."""
import pytest

from cli_contract import run_refused
from gqakit.common.errors import GqakitError
from gqakit.hf import hub


def test_a_missing_local_path_that_looks_like_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hub, "_reachable", lambda: pytest.fail("a local-looking path must not touch the network"))
    with pytest.raises(GqakitError, match=r"^model folder runs/nosuch does not exist; pass the path"):
        hub.check_hub_name("runs/nosuch")


def test_offline_or_unreachable_and_not_cached(monkeypatch):
    monkeypatch.setattr(hub, "_cached", lambda name, filename: False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(GqakitError, match="neither a local folder nor in the Hugging Face cache, and the hub is "
                                          "offline"):
        hub.check_hub_name("someorg/somemodel")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hub, "_reachable", lambda: "cannot connect to huggingface.co: refused")
    with pytest.raises(GqakitError, match="and cannot connect to huggingface.co"):
        hub.check_hub_name("someorg/somemodel")


def test_cached_names_load_from_the_cache_when_the_hub_is_out_of_reach(monkeypatch):
    monkeypatch.setattr(hub, "_cached", lambda name, filename: True)
    monkeypatch.setattr(hub, "_reachable", lambda: "cannot connect to huggingface.co: refused")
    assert hub.check_hub_name("someorg/somemodel") is True  # local_files_only
    monkeypatch.setattr(hub, "_reachable", lambda: None)
    assert hub.check_hub_name("someorg/somemodel") is False  # the hub may serve it


@pytest.mark.parametrize("argv", [["eval", "ppl", "someorg/nosuch", "--text", "t.txt"],
                                  ["generate", "someorg/nosuch", "--prompt", "hi"],
                                  ["eval", "ppl", "runs/nosuch", "--text", "t.txt"]])
def test_the_commands_refuse_in_one_line(tmp_path, argv):
    (tmp_path / "runs").mkdir()
    (tmp_path / "t.txt").write_text("some text\n")
    run_refused(tmp_path, "gqakit", *argv, cwd=tmp_path, env={"HF_HUB_OFFLINE": "1"},
                needles=("does not exist" if argv[2].startswith("runs/") else "hub is offline",))

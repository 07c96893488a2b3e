"""Every device option checks that the device exists here before any work (`common.devices.check_device`):
through the console scripts, a device this machine lacks (cuda on a CPU-only machine, cuda:7 past the last GPU,
mps off Apple silicon, a nonsense name, a device type gqakit does not run on) is refused in one line, exit 2,
nothing written."""
import pytest
import torch

from cli_contract import run_refused
from gqakit.common.devices import check_device
from gqakit.common.errors import GqakitError

REPO_ASSETS = __import__("pathlib").Path(__file__).resolve().parents[2] / "gqakit" / "assets"
EMBEDDED = REPO_ASSETS / "austen-mha-8h"
TEXT = REPO_ASSETS / "heldout_emma.txt"

MISSING = [("nonsense", "unknown"), ("cuda:7", "cuda:7"), ("meta", "not meta"), ("cpu:x", "unknown")]
if not torch.cuda.is_available():
    MISSING += [("cuda", "no CUDA device"), ("cuda:0", "no CUDA device")]
if not torch.backends.mps.is_available():
    MISSING.append(("mps", "no Apple MPS device"))


@pytest.mark.parametrize("device,needle", MISSING)
def test_convert_refuses_a_calibration_device_this_machine_lacks(device, needle, tmp_path):
    line = run_refused(tmp_path, "convert-gqa", "--groups", "2", str(EMBEDDED), "--method", "fit", "--calibration",
                       str(TEXT), "--calibration-device", device, "-o", str(tmp_path / "out"), needles=(needle,))
    assert "--calibration-device" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("device,needle", MISSING)
def test_eval_refuses_a_device_this_machine_lacks(device, needle, tmp_path):
    out = tmp_path / "ppl"
    line = run_refused(tmp_path, "gqakit", "eval", "ppl", str(EMBEDDED), "--text", str(TEXT), "--device", device,
                       "--output", str(out), needles=(needle,))
    assert "--device" in line
    assert not out.exists()


def test_cpu_and_auto_pass_without_torch_and_the_option_is_named():
    assert check_device("cpu", "device") == "cpu" and check_device("auto", "device", auto=True) == "auto"
    with pytest.raises(GqakitError, match="unknown device='auto'"):
        check_device("auto", "device")  # auto only where the option offers it

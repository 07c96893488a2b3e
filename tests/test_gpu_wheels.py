"""benchmarks/gpu/wheels.py: the device call carries only wheels whose needs the GPU image meets. transformers 5.25.0
needs huggingface-hub >= 2.4.0 and the image holds 1.33.0: carried, it failed at import there, after the machine
started (rehearsed on CPU in a Python 3.12 venv holding the image's versions). No network here: the index and the
wheels are stood in for by their METADATA lines."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))
import wheels  # noqa: E402

# Requires-Dist as the real wheels state them (transformers 5.24.0 / 5.25.0, datasets 5.2.0), cut to what matters
TRANSFORMERS = {
    "5.25.0": ["huggingface-hub<3.0,>=2.4.0", "tokenizers<0.24.0,>=0.23.1", "safetensors>=0.8.0", "numpy>=1.17",
               "kernels<0.20,>=0.19.1", "accelerate>=1.1.0; extra == \"torch\""],
    "5.24.0": ["huggingface-hub<3.0,>=1.31.0", "tokenizers<0.24.0,>=0.23.1", "safetensors>=0.8.0", "numpy>=1.17",
               "accelerate>=1.1.0; extra == \"torch\""],
    "5.23.0": ["huggingface-hub<3.0,>=1.31.0"],
}
DATASETS = {"5.2.0": ["dill<0.4.2,>=0.3.0", "multiprocess<0.70.20", "pyarrow>=24.0.0",
                      "tomli>=1.1.0; python_version < \"3.11\""]}
LOCAL = {"transformers": "5.25.0", "datasets": "5.2.0", "dill": "0.4.1", "multiprocess": "0.70.19"}


def metadata(lines: list[str]) -> str:
    return "Metadata-Version: 2.4\nName: x\n" + "".join(f"Requires-Dist: {line}\n" for line in lines)


def fetcher(fetched: list):
    def fetch(name, version):
        fetched.append((name, version))
        return metadata({"transformers": TRANSFORMERS, "datasets": DATASETS}.get(name, {}).get(version, []))
    return fetch


def releases(name):
    return {"transformers": ["5.26.0.dev0", "5.25.0", "5.24.0", "5.23.0", "5.22.2"], "datasets": ["5.2.0", "4.4.1"],
            "dill": ["0.4.1"], "multiprocess": ["0.70.19"]}[name]


def test_the_image_file_holds_what_the_check_reads():
    image = wheels.read_image()
    assert image["huggingface-hub"] == "1.33.0" and image["python"].startswith("3.12")
    assert image["pyarrow"] is None and "dill" not in image and "httpx2" not in image


def test_transformers_goes_back_to_the_newest_release_the_image_meets():
    fetched, said = [], []
    chosen = wheels.choose(list(LOCAL), wheels.read_image(), fetcher(fetched), releases, LOCAL.get, say=said.append)
    assert chosen == {"transformers": "5.24.0", "datasets": "5.2.0", "dill": "0.4.1", "multiprocess": "0.70.19"}
    assert fetched[:2] == [("transformers", "5.25.0"), ("transformers", "5.24.0")]  # never the dev release
    assert "not 5.25.0: needs huggingface-hub<3.0,>=2.4.0 (there: 1.33.0)" in said[0]
    assert "unchecked: pyarrow>=24.0.0" in said[1] and "tomli" not in said[1]  # a marker that is false there


def test_no_release_in_range_is_one_line_naming_the_need():
    image = {**wheels.read_image(), "huggingface-hub": "1.20.0"}
    with pytest.raises(SystemExit) as stop:
        wheels.choose(["transformers"], image, fetcher([]), releases, LOCAL.get, say=lambda line: None)
    message = str(stop.value)
    assert "\n" not in message and "huggingface-hub<3.0,>=1.31.0 (there: 1.20.0)" in message
    assert "5.22.2" not in message  # below pyproject.toml's transformers>=5.23


def test_a_need_the_image_lacks_and_nothing_carries_is_unmet():
    environment = wheels.marker_environment("3.12.3")
    problems, unchecked = wheels.unmet(wheels.needs(metadata(["httpx2<3,>=2.0.0", "pyarrow>=24"]), environment),
                                       {"pyarrow": None})
    assert problems == ["httpx2<3,>=2.0.0 (the image lacks httpx2 and it is not carried)"]
    assert unchecked == ["pyarrow>=24 (the image's version is not recorded)"]


def test_markers_are_read_for_the_images_interpreter():
    """implementation_version and python_version are the image's 3.12, not this machine's interpreter."""
    environment = wheels.marker_environment("3.12.3")
    lines = ['old>=1; implementation_version < "3.12"', 'older>=1; python_version < "3.12"', "kept>=1"]
    assert [str(r) for r in wheels.needs(metadata(lines), environment)] == ["kept>=1"]

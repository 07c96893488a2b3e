"""A plan is arithmetic over config.json and the safetensors headers: `convert-gqa --dry-run` and `gqakit uptrain
--plan` print it without importing torch or transformers (in a fresh process, whose modules are then read), and
print the same text as when torch and transformers are already loaded. Also for the re-hosted families (their
config.json written as a diff against the class's defaults, as older transformers saved it), --calibration given
to a dry run (counted with tokenizer.json, or left to the conversion), and the memory plan of a config.json that
leaves fields to the class's defaults, with its weights or alone."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fork_cli import PRELOAD, serving

REPO = Path(__file__).resolve().parents[1]
EMBEDDED = str(REPO / "gqakit" / "assets" / "austen-mha-8h")
RECIPE = str(REPO / "recipes" / "uptrain_embedded.yaml")
HEAVY = ("torch", "transformers")

_RUN = """import sys
from gqakit.cli import convert_main, main
rc = (convert_main if sys.argv[1] == "convert-gqa" else main)(sys.argv[2:])
print("LOADED", *[m for m in {heavy!r} if m in sys.modules], file=sys.stderr)
sys.exit(rc)
"""


def _run(argv: list[str], cwd: Path) -> tuple[str, list[str]]:
    """The command's output in a fresh process, and which of HEAVY it had imported at the end."""
    code = _RUN.format(heavy=HEAVY)
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=cwd, timeout=300)
    assert done.returncode == 0, done.stderr
    loaded = [line for line in done.stderr.splitlines() if line.startswith("LOADED")][-1].split()[1:]
    return done.stdout, loaded


@pytest.fixture(scope="module")
def loaded():
    """The console scripts forked from a process that has torch and transformers loaded (tests/support/fork_cli.py,
    whose PRELOAD they lead), and the server's log."""
    assert PRELOAD[:2] == HEAVY
    folder = Path(tempfile.mkdtemp(prefix="plans-loaded-"))
    try:
        with serving({**os.environ, "OMP_NUM_THREADS": "1"}, folder) as env:
            yield env, folder / "fork-cli.log"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _run_loaded(argv: list[str], cwd: Path, loaded) -> str:
    """The command's output with torch and transformers already loaded."""
    env, log = loaded
    done = subprocess.run([shutil.which(argv[0], path=env["PATH"]), *argv[1:]], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines()[-1] == f"served {' '.join(argv)}"  # not the real script, fresh
    return done.stdout


TEXT = str(REPO / "gqakit" / "assets" / "heldout_emma.txt")
REHOSTED = ("gpt2", "opt", "gptj", "neox", "neox-seq", "t5", "mt5")  # tiny checkpoints the `models` fixture makes

PLANS = {
    "convert mean": ["convert-gqa", "--groups", "2", EMBEDDED, "--dry-run"],
    "convert fit": ["convert-gqa", "--groups", "2", EMBEDDED, "--dry-run", "--method", "fit"],
    "convert transfer": ["convert-gqa", "--groups", "1", EMBEDDED, "--dry-run", "--method", "transfer"],
    "convert mla trained": ["convert-gqa", "--groups", "1", EMBEDDED, "--dry-run", "--method", "transfer",
                            "--to", "mla", "--kv-rank", "48", "--rope-dim", "16", "--bias-free"],
    "uptrain": ["gqakit", "uptrain", RECIPE, "--plan", f"model={EMBEDDED}", "teacher=null", "batch_size=100000000",
                "--device-memory", "80GB"],
    "uptrain teacher fsdp": ["gqakit", "uptrain", RECIPE, "--plan", f"model={EMBEDDED}", f"teacher={EMBEDDED}",
                             "sharding=fsdp", "--processes", "4", "--device-memory", "1GB"],
    **{f"convert {name}": ["convert-gqa", "--groups", "2", "{%s}" % name, "--dry-run"] for name in REHOSTED},
    "convert fit calibration": ["convert-gqa", "--groups", "2", EMBEDDED, "--dry-run", "--method", "fit",
                                "--calibration", TEXT],
    "convert fit calibration left to the run": ["convert-gqa", "--groups", "2", "{gpt2 tokenizer}", "--dry-run",
                                                "--method", "fit", "--calibration", TEXT],
    "uptrain defaults": ["gqakit", "uptrain", RECIPE, "--plan", "model={defaults}", "teacher=null",
                         "--device-memory", "80GB"],
    "uptrain config alone": ["gqakit", "uptrain", RECIPE, "--plan", "model={config alone}", "teacher={defaults}",
                             "--device-memory", "80GB"],
}
SAYS = {  # what these plans must print, beyond printing it without torch
    "convert fit calibration": "counted with tokenizer.json as transformers counts",
    "convert fit calibration left to the run": "checked when converting: its tokenizer_config.json names GPT2Tokenizer",
    "convert gpt2": "re-hosted: GPT-2",
    "uptrain config alone": "8,917,248 parameters",  # untied: LlamaConfig's default
    "uptrain defaults": "7,868,672 parameters",
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """Tiny re-hosted checkpoints, config.json as a diff against the class's defaults; the embedded model with its
    tokenizer declared as GPT2Tokenizer (which only transformers builds); the embedded model's config.json without
    head_dim and num_key_value_heads beside its weights (linked), and, also without tie_word_embeddings, alone."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM, MT5Config, T5Config

    from families import make_model

    root = tmp_path_factory.mktemp("plans")
    paths = {}
    for name in REHOSTED:
        path = root / name
        if name in ("t5", "mt5"):
            cls = T5Config if name == "t5" else MT5Config
            AutoModelForSeq2SeqLM.from_config(cls(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                                                  num_heads=4, decoder_start_token_id=0)).save_pretrained(path)
        else:
            make_model(name, path)
        config = AutoConfig.from_pretrained(path)
        (path / "config.json").write_text(config.to_json_string(use_diff=True))
        paths[name] = str(path)
    tokenizer = root / "gpt2-tokenizer"
    tokenizer.mkdir()
    for name in os.listdir(EMBEDDED):
        os.symlink(Path(EMBEDDED) / name, tokenizer / name)
    settings = json.loads((tokenizer / "tokenizer_config.json").read_text())
    (tokenizer / "tokenizer_config.json").unlink()
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({**settings, "tokenizer_class": "GPT2Tokenizer"}))
    paths["gpt2 tokenizer"] = str(tokenizer)
    config = json.loads((Path(EMBEDDED) / "config.json").read_text())
    for name, left_out in (("defaults", ("head_dim", "num_key_value_heads")),
                           ("config alone", ("head_dim", "num_key_value_heads", "tie_word_embeddings"))):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in left_out}))
        paths[name] = str(root / name)
    os.symlink(Path(EMBEDDED) / "model.safetensors", root / "defaults" / "model.safetensors")
    return paths


@pytest.mark.parametrize("name", sorted(PLANS))
def test_plan_loads_neither_torch_nor_transformers_and_prints_the_same(name, tmp_path, models, loaded):
    argv = [arg.format(**models) if arg.startswith("{") or "={" in arg else arg for arg in PLANS[name]]
    light, imported = _run(argv, cwd=tmp_path)
    assert imported == [], f"{name}: the plan imported {imported}"
    heavy = _run_loaded(argv, tmp_path, loaded)
    assert light == heavy and light.strip()
    assert SAYS.get(name, "") in light
    assert list(tmp_path.iterdir()) == []  # nothing written

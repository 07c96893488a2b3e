#!/usr/bin/env bash
# The torch floor check of docs/architecture.md ("Dependency floors"): one fresh venv per torch release, gqakit
# installed editable with its test extra (transformers etc. as pip resolves them), then the smoke subset below,
# and one markdown row per venv: versions, pass / fail counts, minutes.
#
#   benchmarks/floors.sh [VENV_ROOT]              # venvs under VENV_ROOT (default /tmp/gqakit-floors), reused
#   TORCHES="2.12.1" benchmarks/floors.sh          # other torch releases (default: 2.11.0 2.15.0)
#   TRANSFORMERS=5.17.0 TORCHES=2.11.0 benchmarks/floors.sh   # a transformers below our floor: gqakit --no-deps
#
# Needs the package index. On these machines a pip constraint caps torch at the releases on the local disk: run
# it as `PIP_CONSTRAINT=/dev/null benchmarks/floors.sh` to reach newer ones (an empty value does not lift it).
# The index's Linux torch wheels carry CUDA (a few GB per venv); the tests run on the CPU. Logs: VENV/smoke.log.
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
ROOT="${1:-/tmp/gqakit-floors}"
TORCHES="${TORCHES:-2.11.0 2.15.0}"
TRANSFORMERS="${TRANSFORMERS:-}"
PYTHON="${PYTHON:-python3}"
# The smoke subset: kernels and masks, ring attention on 2 gloo processes, the merge methods, uptraining on 1
# and 2 processes (DDP, context parallelism), perplexity, the floor rule and the CLI. Not slow-marked ones.
SMOKE=(
  tests/attention/test_tiled.py tests/attention/test_attention_masks.py tests/attention/test_ring.py
  tests/convert/test_pooling.py tests/convert/test_convert_aligned.py tests/convert/test_calibrate.py
  tests/convert/test_transfer.py
  tests/uptrain/test_uptrain.py tests/uptrain/test_uptrain_multiprocess.py
  tests/evaluate/test_eval_ppl.py
  tests/test_floors.py tests/test_cli.py
)
# Left out for time (each a minute or so of subprocesses, none of them torch-specific): refusals said in one line.
SKIP=(
  tests/convert/test_calibrate.py::test_bad_calibration_input_is_refused_in_one_line
  tests/convert/test_transfer.py::test_transfer_options_are_refused_elsewhere
  tests/test_cli.py::test_edges_are_one_line_with_the_fix
  tests/uptrain/test_uptrain_multiprocess.py::test_accelerate_cpu_launch_of_n_processes_is_refused
  tests/uptrain/test_uptrain_multiprocess.py::test_an_error_under_torchrun_is_said_once
)

echo "| torch | transformers | accelerate | python | passed | failed | skipped | minutes |"
echo "|---|---|---|---|---|---|---|---|"
status=0
for torch_version in $TORCHES; do
  venv="$ROOT/torch-$torch_version${TRANSFORMERS:+-tf$TRANSFORMERS}"
  log="$venv/smoke.log"
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv" || exit 1
  if [ -n "$TRANSFORMERS" ]; then
    "$venv/bin/pip" install -q "torch==$torch_version" "transformers==$TRANSFORMERS" "accelerate>=1.1" \
      "datasets>=4.0" safetensors tokenizers tqdm pyyaml matplotlib pytest gguf optimum-quanto >"$venv/pip.log" 2>&1 &&
      "$venv/bin/pip" install -q --no-deps -e "$REPO" >>"$venv/pip.log" 2>&1
  else
    "$venv/bin/pip" install -q "torch==$torch_version" -e "$REPO[test]" >"$venv/pip.log" 2>&1
  fi || { echo "| $torch_version | pip failed: see $venv/pip.log |"; status=1; continue; }
  versions=$("$venv/bin/python" -c 'import sys, torch, transformers, accelerate
print(torch.__version__, transformers.__version__, accelerate.__version__, sys.version.split()[0], sep=" | ")')
  start=$(date +%s)
  (cd "$REPO" && PYTHONPATH="$REPO" "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" "${SMOKE[@]}" \
    "${SKIP[@]/#/--deselect=}") \
    >"$log" 2>&1 || status=1
  minutes=$(awk -v s="$(( $(date +%s) - start ))" 'BEGIN { printf "%.1f", s / 60 }')
  summary=$(tail -n 1 "$log")
  count() { grep -oE "[0-9]+ $1" <<<"$summary" | grep -oE "[0-9]+" || echo 0; }
  echo "| $versions | $(count passed) | $(( $(count failed) + $(count error) )) | $(count skipped) | $minutes |"
done
exit $status

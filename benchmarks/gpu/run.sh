#!/usr/bin/env bash
# The GPU device check (issue 32): the one script the lent GPU machine runs, from the repository root:
#   bash benchmarks/gpu/run.sh
# after benchmarks/gpu/prepare.sh filled .whl/ here (the call carries it: carry=[".whl"]). At most ~8 minutes:
#   setup (wheels, versions)    ~20 s
#   pytest -m cuda tests/cuda   150 s   CUDA kernels against the fp64 reference, conversions, uptrain, sinks
#   benchmarks/gpu/decode.py    150 s   MHA / GQA / MQA / MLA decode of a 1B-class Llama shape, eager and captured
#   benchmarks/gpu/train.py     120 s   attention fwd+bwd (tiled / flex / sdpa), uptrain vs a bare loop
#   benchmarks/gpu/summary.py     5 s   one summary table; report.md, report.json, decode.png
# Each part runs under `timeout` with its budget (cut to what is left of TOTAL_S); a part that fails or runs out
# does not stop the next. Everything lands in $OUT (a folder of its own: ./scratch/gpu-check when unset); the
# script exits non-zero when any part or check failed. The test suite's cuda tests skip (in well under a second)
# where no GPU is. DRY_RUN=1 runs the benchmarks' CPU dry runs instead (the
# whole script on a machine without a GPU, the cuda tests skipping). The tests run in parallel processes where
# pytest-xdist is installed (the GPU image has it; each mask pattern compiles flex_attention anew, ~10 s of CPU).
# A focused rerun narrows it: PARTS (default "pytest decode train"), PYTEST_S / DECODE_S / TRAIN_S (budgets, s),
# DECODE_ARGS / TRAIN_ARGS (more options, e.g. DECODE_ARGS="--batches 32 --contexts 32768").
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/scratch/gpu-check}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gqakit-gpu.XXXXXX")
TOTAL_S=${TOTAL_S:-470}
PARTS=${PARTS:-pytest decode train}
WHEELS=${WHEELS:-.whl}  # the carried wheels (tests point it elsewhere: no install into /tmp/site)
START=$(date +%s)
mkdir -p "$OUT"

left() { echo $(( TOTAL_S - ($(date +%s) - START) )); }
in_parts() { [[ " $PARTS " == *" $1 "* ]]; }
wanted() { in_parts "$1" && echo "$2" || echo 0; }  # wanted NAME BUDGET: its budget, 0 if not in PARTS
PYTEST_S=$(wanted pytest "${PYTEST_S:-150}") DECODE_S=$(wanted decode "${DECODE_S:-150}")
TRAIN_S=$(wanted train "${TRAIN_S:-120}")

part() {  # part NAME BUDGET_S RESERVE_S COMMAND...: run under timeout (leaving RESERVE_S), a line in parts.tsv
    local name=$1 budget=$2 reserve=$3; shift 3
    if ! in_parts "$name"; then echo "== $name: not in PARTS"; return; fi
    local cap=$(( $(left) - reserve ))
    (( budget > cap )) && budget=$cap
    if (( budget < 15 )); then
        echo "== $name: skipped, ${budget} s left of the script's ${TOTAL_S}"
        printf '%s\t%s\t0\t125\n' "$name" "$budget" >>"$WORK/parts.tsv"
        return
    fi
    echo "== $name (budget ${budget} s): $*"
    local t0=$(date +%s)
    # SIGINT, not SIGTERM: pytest then writes its junit report of what finished, and the benchmarks their JSON
    BUDGET_S=$budget timeout -s INT -k 15 "$budget" "$@"
    local rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$budget" $(( $(date +%s) - t0 )) "$rc" >>"$WORK/parts.tsv"
    echo "== $name: exit $rc after $(( $(date +%s) - t0 )) s"
}

main() {
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$WHEELS"/*.whl || { echo "installing the carried wheels failed"; return 1; }
        export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "no .whl/ here: run benchmarks/gpu/prepare.sh before the device call (the image's transformers is old)"
        export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    fi
    export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
    export GQAKIT_CACHE_DIR=$WORK/token-cache MPLBACKEND=Agg
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    # the image's own packages (not the carried ones), read before anything is imported, so that a failed import
    # still leaves the reading benchmarks/gpu/image.txt is updated from
    python3 - "$OUT/image-packages.txt" <<'PY'
import importlib.metadata as m, sys
own = sorted({"%s==%s" % (d.metadata["Name"], d.version) for d in m.distributions()
              if not str(d.locate_file("")).startswith("/tmp/site")})
open(sys.argv[1], "w").write("\n".join(own) + "\n")
PY
    python3 - "$WORK/versions.json" <<'PY'
import json, subprocess, sys
sys.path.insert(0, "benchmarks/gpu")
from _gpu import versions
import torch
out = versions("cuda" if torch.cuda.is_available() else "cpu")
try:
    out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                   capture_output=True, text=True).stdout.strip()
except OSError:
    out["driver"] = None
import importlib.metadata as m
for name in ("accelerate", "datasets", "pyarrow", "fsspec", "huggingface_hub", "tokenizers", "safetensors", "triton"):
    try:
        out[name] = m.version(name)
    except m.PackageNotFoundError:
        out[name] = None
import datasets, gqakit  # noqa: F401  both must import before anything runs
print(json.dumps(out, indent=1))
open(sys.argv[1], "w").write(json.dumps(out))
PY
    (( $? == 0 )) || { echo "the carried wheels do not import over the image's packages (above); fix" \
        "benchmarks/gpu/image.txt or the wheels (benchmarks/gpu/wheels.py), then run prepare.sh again"; return 1; }
    local workers=()  # half the cores, at most 8, where pytest-xdist is installed
    python3 -c "import xdist" 2>/dev/null && workers=(-n "$(( $(nproc) > 16 ? 8 : ($(nproc) + 1) / 2 ))")
    part pytest "$PYTEST_S" $(( DECODE_S + TRAIN_S + 10 )) \
        sh -c 'work=$1 out=$2; shift 2
        GQAKIT_TEST_DEADLINE=$(( $(date +%s) + BUDGET_S - 20 )) python3 -m pytest -m cuda tests/cuda -q \
        -p no:cacheprovider -o junit_family=xunit1 "$@" --junitxml "$work/pytest.xml" --durations=15 \
        >"$out/pytest.log" 2>&1' sh "$WORK" "$OUT" "${workers[@]}"
    tail -n 30 "$OUT/pytest.log"
    part decode "$DECODE_S" $(( TRAIN_S + 10 )) \
        sh -c 'python3 benchmarks/gpu/decode.py $2 $3 --budget-s $((BUDGET_S - 25)) \
        --json "$1/decode.json" >"$1/decode.md"' sh "$WORK" "${DRY_RUN:+--dry-run}" "${DECODE_ARGS:-}"
    cat "$WORK/decode.md" 2>/dev/null
    part train "$TRAIN_S" 10 sh -c 'python3 benchmarks/gpu/train.py $2 $3 --budget-s $((BUDGET_S - 25)) \
        --json "$1/train.json" >"$1/train.md"' sh "$WORK" "${DRY_RUN:+--dry-run}" "${TRAIN_ARGS:-}"
    cat "$WORK/train.md" 2>/dev/null
    echo
    python3 benchmarks/gpu/summary.py "$WORK" "$OUT"
}

main 2>&1 | tee "$OUT/run.log"
rc=${PIPESTATUS[0]}
rm -rf "$WORK"
exit "$rc"

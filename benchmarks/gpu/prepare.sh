#!/usr/bin/env bash
# Run HERE, before the device call (it needs the package index; the GPU machine has no network): downloads into
# .whl/ (ignored by git through .git/info/exclude) the wheels the GPU image lacks, all pure Python: transformers
# at the version this environment has (the image holds 5.17.0, below our floor), datasets and the needs of it
# that the image lacks (dill, multiprocess). Then prints the device call that runs benchmarks/gpu/run.sh.
#
#   bash benchmarks/gpu/prepare.sh              # PYTHON=... picks the interpreter whose versions are copied
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
exclude=$(git rev-parse --git-path info/exclude)
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
wanted=()
for name in transformers datasets dill multiprocess; do wanted+=("$name==$(version "$name")"); done
rm -rf .whl && mkdir .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${wanted[@]}"
ls -l .whl
tree_mib=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
whl_mib=$(du -cb .whl/*.whl | tail -1 | cut -f1)
total=$(( (tree_mib + whl_mib) / 1048576 ))
echo "working tree + wheels: about ${total} MiB of the 64 MiB a device call may carry"
[ "$total" -lt 64 ] || { echo "too large to travel: carry fewer wheels" >&2; exit 1; }
cat <<'CALL'

Device call (the device tool's run; one H100 or H200, about 8 minutes of script):
  run(command="bash benchmarks/gpu/run.sh", carry=[".whl"], timeout_s=540)
Its report comes back under files_at: report.md, report.json, pytest.log, run.log, decode.png.
CALL

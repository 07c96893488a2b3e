#!/usr/bin/env bash
# Run HERE, before the device call (it needs the package index; the GPU machine has no network): downloads into
# .whl/ (ignored by git through .git/info/exclude) the wheels the GPU image lacks, all pure Python: transformers
# (the image holds 5.17.0, below our floor), datasets and the needs of it that the image lacks (dill,
# multiprocess), each at the newest release, up to this environment's, whose needs the image's own packages meet
# (benchmarks/gpu/wheels.py, against benchmarks/gpu/image.txt). Then prints the device call that runs
# benchmarks/gpu/run.sh.
#
#   bash benchmarks/gpu/prepare.sh              # PYTHON=... picks the interpreter whose versions are the newest
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
exclude=$(git rev-parse --git-path info/exclude)
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
rm -rf .whl
"$PY" benchmarks/gpu/wheels.py --dest .whl transformers datasets dill multiprocess
ls -l .whl
tree_mib=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
whl_mib=$(du -cb .whl/*.whl | tail -1 | cut -f1)
total=$(( (tree_mib + whl_mib) / 1048576 ))
echo "working tree + wheels: about ${total} MiB of the 64 MiB a device call may carry"
[ "$total" -lt 64 ] || { echo "too large to travel: carry fewer wheels" >&2; exit 1; }
cat <<'CALL'

Device call (the device tool's run; one H100 or H200, about 8 minutes of script):
  run(command="bash benchmarks/gpu/run.sh", carry=[".whl"], timeout_s=540)
Its report comes back under files_at: report.md, report.json, pytest.log, run.log, decode.png,
image-packages.txt.
CALL

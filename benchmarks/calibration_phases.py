"""Where a calibrated conversion's peak memory is: the RSS of one `convert-gqa --method fit --calibration`
run on a synthetic Llama-2-7B-shaped checkpoint, sampled every 20 ms and split into its phases by its own
progress bars: start-up (imports, the calibration text tokenized, the windows through the embedding),
calibration (layer by layer), and the conversion that merges each layer from its stored statistics.

    OMP_NUM_THREADS=1 python benchmarks/calibration_phases.py                # 2 layers, windows of 512
    OMP_NUM_THREADS=1 python benchmarks/calibration_phases.py --layers 4 --window 128

Progress goes to stderr; stdout is the markdown report. Sampling can miss a peak shorter than 20 ms, so the
phase peaks are at most the process's VmHWM (`calibration_memory.py` reports that).
"""
from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _measure import PRESETS, PRIDE, ROOT, logger, rss_mib, write_random_llama

log = logger("calibration_phases")
PHASES = ("start-up: imports, calibration text, windows through the embedding", "calibration, layer by layer",
          "merge and write")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--scratch", default=str(ROOT / "runs"))
    args = ap.parse_args(argv)
    shape = dataclasses.replace(PRESETS["7b"], layers=args.layers)
    Path(args.scratch).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="calibration-phases-", dir=args.scratch))
    try:
        log(f"synthesising a {shape.label(shape.heads)} bf16 checkpoint ...")
        write_random_llama(work / "src", shape, 5 << 30)
        cmd = ["convert-gqa", "--groups", str(args.groups), str(work / "src"), "-o", str(work / "out"), "--method",
               "fit", "--calibration", str(PRIDE), "--calibration-tokens", str(args.windows * args.window),
               "--calibration-window", str(args.window)]
        log(" ".join(cmd))
        phase = [0]  # index into PHASES, moved on by the child's progress bars

        def follow(stream):
            for line in iter(lambda: stream.readline(), ""):
                for part in line.replace("\r", "\n").split("\n"):
                    if part.startswith("calibrate:"):
                        phase[0] = max(phase[0], 1)
                    elif part.startswith("convert:"):
                        phase[0] = 2

        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        threading.Thread(target=follow, args=(proc.stderr,), daemon=True).start()
        peaks = {p: (0.0, 0.0) for p in PHASES}  # phase -> (peak MiB, seconds into the run)
        while proc.poll() is None:
            mib = rss_mib(proc.pid)  # NaN once the child has exited
            if mib > peaks[PHASES[phase[0]]][0]:
                peaks[PHASES[phase[0]]] = (mib, time.perf_counter() - start)
            time.sleep(0.02)
        if proc.returncode != 0:
            raise SystemExit(f"convert-gqa failed with exit status {proc.returncode}")
        seconds = time.perf_counter() - start
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"## Peak RSS by phase: {shape.label(args.groups)}, bf16, --method fit, {args.windows} windows of "
          f"{args.window} calibration tokens ({seconds:.0f} s in all)\n")
    print("| phase | peak RSS MiB | at s |")
    print("|---|---|---|")
    for name, (mib, at) in peaks.items():
        print(f"| {name} | {mib:,.0f} | {at:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

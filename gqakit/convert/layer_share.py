"""Attention transfer's layers split over processes: `torchrun --nproc_per_node N $(which convert-gqa) ...`.

With the original model's inputs (teacher forcing, the default `--transfer-inputs original`) every layer's
training is independent of the others, so process r trains the layers i with i % N == r. Every process runs
the calibration pass itself (a layer's inputs are the earlier layers' outputs; its forward is cheap beside
the training), in its own scratch folder inside the output's temporary folder, and writes each of its
trained layers there, beside its held-out errors. Rank 0 owns the output: it makes the temporary folder,
tells the others where it is, waits until every process has written its layers, and writes the checkpoint
and its card. Each layer is trained exactly as in one process (its seed is its own), so the output is the
one-process output with the same threads per process (tested to the byte).

Under torchrun, every other method, `--transfer-inputs converted` (each layer waits for the one before) and
`--dry-run` are refused in one line: one process does them.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path

from gqakit.common import launcher
from gqakit.common.errors import GqakitError, opt

WAIT = datetime.timedelta(days=2)  # the slowest process's share of a 70B's layers, with room


@dataclasses.dataclass(frozen=True)
class Share:
    """This process's part of a conversion split over `world` processes."""

    rank: int = 0
    world: int = 1

    def owns(self, layer: int) -> bool:
        return layer % self.world == self.rank

    @property
    def main(self) -> bool:
        return self.rank == 0


def launched_share() -> Share:
    """The share torchrun's environment gives this process (one process: the whole conversion)."""
    world = launcher.world_size()
    return Share(launcher.rank(), world) if world > 1 else Share()


def check_share(share: Share, method_transfers: bool, inputs: str, dry_run: bool) -> None:
    if share.world == 1:
        return
    if not method_transfers:
        raise GqakitError(f"convert-gqa under torchrun ({share.world} processes) splits only "
                          f"{opt('method', 'transfer')}'s layers; run other methods as one process (without torchrun)")
    if inputs == "converted":
        raise GqakitError(f"{opt('transfer.inputs', 'converted')} trains each layer on the layers before it, which "
                          "cannot be split over processes; run it as one process or drop the option")
    if dry_run:
        raise GqakitError(f"{opt('dry_run')} under torchrun: run it as one process (without torchrun)")


def start(share: Share) -> None:
    """Join torchrun's process group (gloo: only a broadcast and barriers pass through it)."""
    import torch.distributed as dist

    if share.world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo", timeout=WAIT)


def finish(share: Share) -> None:
    import torch.distributed as dist

    if share.world > 1 and dist.is_initialized():
        dist.destroy_process_group()


def meeting_folder(share: Share, folder: Path | None) -> Path:
    """Rank 0's `folder` (where trained layers meet), told to every process."""
    if share.world == 1:
        return folder
    import torch.distributed as dist

    box = [str(folder) if share.main else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def barrier(share: Share) -> None:
    if share.world > 1:
        import torch.distributed as dist

        dist.barrier()


def errors_path(folder: Path, layer: int) -> Path:
    return folder / f"transferred-{layer:05d}.json"


def write_errors(folder: Path, layer: int, errors: dict[str, float]) -> None:
    errors_path(folder, layer).write_text(json.dumps(errors), encoding="utf-8")


def read_errors(folder: Path, layers: range, share: Share) -> dict[int, dict[str, float]]:
    """The held-out errors of the layers the other processes trained."""
    return {i: json.loads(errors_path(folder, i).read_text(encoding="utf-8")) for i in layers if not share.owns(i)}

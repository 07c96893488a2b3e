"""Run by the multi-process tests under torchrun: uptrain a recipe; after the last step every rank
saves its weights and the gradients of that step (rank-R.safetensors, keys `grad.NAME` for gradients)
and the step's metrics (rank-R.json) in DUMP_DIR (sharded tensors gathered whole), and a digest of its torch
RNG state (rng-R.txt).

With GQAKIT_TEST_STALL_AT=k, every rank stops after step k (after that step's checkpoint is written),
writes its pid to DUMP_DIR/stalled-RANK.pid and waits to be killed: the tests SIGKILL the run there."""
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from gqakit.common.recipes import load_recipe
from gqakit.uptrain import UptrainConfig, uptrain
from gqakit.uptrain.fsdp import full_tensor


def main() -> None:
    torch.set_num_threads(1)
    recipe, dump = sys.argv[1], Path(sys.argv[2])
    cfg = load_recipe(UptrainConfig, recipe, sys.argv[3:])
    stall_at = int(os.environ.get("GQAKIT_TEST_STALL_AT", "0"))

    def save(step, row, model):
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if step == stall_at:
            (dump / f"stalled-{rank}.pid").write_text(str(os.getpid()))  # torchrun's workers have their own
            while True:                                                     # process groups: the test kills each
                time.sleep(1)
        if step == cfg.steps:
            state = {k: full_tensor(v.detach()).clone() for k, v in model.state_dict().items()}
            state.update({f"grad.{k}": full_tensor(p.grad.detach()).clone() for k, p in model.named_parameters()
                          if p.grad is not None})  # FSDP: DTensors gathered whole (every rank takes part)
            save_file(state, str(dump / f"rank-{rank}.safetensors"))
            (dump / f"rank-{rank}.json").write_text(json.dumps(row))
            (dump / f"rng-{rank}.txt").write_text(hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest())

    uptrain(cfg, on_step=save)
    if torch.distributed.is_initialized():  # as gqakit's CLI does: a rank that exits with the gloo group alive
        torch.distributed.destroy_process_group()  # can abort in its teardown ("terminate called without...")
    # Even so, under load a gloo thread torn down during interpreter exit aborted a rank once (after its results and
    # the run folder were written: the FSDP Nemotron test, beside another test run), as fsdp_load_worker.py saw.
    # What the tests check is written by now, so leave without running C++ static destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

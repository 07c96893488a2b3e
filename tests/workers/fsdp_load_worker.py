"""Run by tests/uptrain/test_uptrain_fsdp.py under torchrun: load MODEL_DIR sharded (gqakit.uptrain.fsdp) and
write, from rank 0, the names of the tensors whose gathered value differs from the file to OUT."""
import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from gqakit.uptrain import fsdp


def main() -> None:
    torch.set_num_threads(1)
    model_dir, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    model = fsdp.load_sharded(model_dir, fsdp.make_mesh("cpu"), fsdp.mp_policy("no"), torch.device("cpu"))
    saved = load_file(f"{model_dir}/model.safetensors")
    state = model.state_dict()
    differ = [k for k in sorted(state) if not torch.equal(fsdp.full_tensor(state[k]), saved[k])]  # every rank gathers
    local = {k: list(v.to_local().shape) for k, v in state.items() if hasattr(v, "to_local")}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"differ": differ, "names": sorted(state), "local_shapes": local}, f)
    dist.barrier()
    dist.destroy_process_group()  # a rank that exits with the group alive may abort in gloo's teardown
    # Even so, a loaded machine showed "terminate called without an active exception" from a gloo thread torn
    # down during interpreter exit (after the results were written). What this test checks is the file above, so
    # leave without running C++ static destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

"""The sharded parts of a checkpoint, written and read with ``torch.distributed.checkpoint`` (DCP): the master
weights where they are wider than the HF weights beside them, and the optimizer state under FSDP2, each rank its
shard; any world size, one process included, reads them back."""

from __future__ import annotations

from pathlib import Path

OPTIM_DCP = "optim_dcp"
MASTER_DCP = "master_dcp"


def save_master_weights(model, ckpt_tmp: Path) -> None:
    """The policy's master (fp32) weights, for an exact resume when the HF weights beside them are written
    in the lower compute dtype; sharded under FSDP2 (every rank calls this), one file otherwise."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    dcp.save(get_model_state_dict(model), checkpoint_id=str(ckpt_tmp / MASTER_DCP))


def load_master_weights(model, ckpt: Path) -> bool:
    """Load master weights written by ``save_master_weights`` (any world size); False if there are none."""
    if not (ckpt / MASTER_DCP).is_dir():
        return False
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=str(ckpt / MASTER_DCP))
    set_model_state_dict(model, state)
    return True


def save_sharded_optimizer(model, optimizer, ckpt_tmp: Path) -> None:
    """Under FSDP2: every rank writes its optimizer shard with DCP into the checkpoint being written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=str(ckpt_tmp / OPTIM_DCP))


def load_sharded_optimizer(model, optimizer, ckpt: Path) -> None:
    """Load a DCP optimizer state written by any number of ranks into this run's (sharded or not) one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer)  # the target layout (states initialised)
    dcp.load(state, checkpoint_id=str(ckpt / OPTIM_DCP))
    set_optimizer_state_dict(model, optimizer, state)

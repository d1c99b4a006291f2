"""Sharded, atomic training checkpoints (torch.distributed.checkpoint), verified before use.

Layout of one checkpoint, `root/step_{step:08d}/`:

    model_optim/          DCP checkpoint of {"model", "optim", "extra"}; every rank writes its own shards
    rng/rank_00000.pt     RNG states (python `random`, numpy, torch CPU, CUDA) of each rank at save time
    trainer.pt            scheduler state_dict and the caller's `trainer_state` (written by rank 0)
    manifest.json         step, world size, time, torch version, every file's size and xxh3-128 digest: written
                          last, it marks the checkpoint complete

Atomicity: everything is written into `root/.tmp_step_{step:08d}/`; after every rank has finished (and
fsynced) its files, rank 0 writes the manifest and renames the directory to `step_{step:08d}` with
`os.replace` (atomic on one filesystem). A crash mid-save therefore leaves at most a `.tmp_step_*`
directory, which is never listed and is removed by the next save; an exception mid-save removes it at
once and raises on every rank (no rank is left waiting in a collective). Old checkpoints beyond
`keep_last` are first renamed to `.trash_step_*` and then deleted, so a crash while pruning cannot leave a
half-deleted checkpoint that looks complete.

Model and optimizer state go through `torch.distributed.checkpoint.state_dict.get_state_dict` /
`set_state_dict`, so one code path serves a plain module (no process group needed), DDP (the `module.`
prefix is dropped) and FSDP2 (DTensor shards); a checkpoint saved on W ranks loads on any other number
of ranks, or into a plain module in a single process, because DCP reshards on load.

RNG and a change of world size: rank r restores the states saved by rank r. When resuming on more ranks
than saved, the extra ranks keep the RNG state they had before `load` (whatever the trainer seeded) and
a warning says so; when resuming on fewer ranks, the states of the missing ranks are ignored. RNGs that
live in objects (a DataLoader's generator, a sampler's seed) are not global state: put what is needed to
rebuild them (epoch, index into the sampler, seed) into `trainer_state`.

Requirements: `root` must be one directory that every rank sees (a shared filesystem when training on
several nodes), and only one job may write checkpoints into it at a time. Checkpoints contain pickles
(DCP metadata, `trainer.pt`): load only checkpoints you trust.

This module needs torch.distributed only (no Accelerate), so it works under torchrun, Accelerate or a
plain single process. Every function documented as collective must be called by all ranks of the
default process group, in the same order.

Modules: errors (the exceptions), collective (rank agreement), layout (names, manifest, durable writes),
state (DCP state dicts, RNG), verify (intact or not, digests), manager (CheckpointManager). The policy
export (safetensors) is vla.training.export.
"""

from vla.eval.exported import read_safetensors_metadata
from vla.training.checkpoint.collective import _agree, _capture, _first
from vla.training.checkpoint.errors import (
    CheckpointError,
    DamagedCheckpointError,
    NonFiniteWeightsError,
    check_finite_tensors,
)
from vla.training.checkpoint.layout import MANIFEST, MODEL_OPTIM_DIR, RNG_DIR, TRAINER_FILE
from vla.training.checkpoint.manager import CheckpointManager
from vla.training.checkpoint.verify import verify_checkpoint

__all__ = [
    "MANIFEST",
    "MODEL_OPTIM_DIR",
    "RNG_DIR",
    "TRAINER_FILE",
    "CheckpointError",
    "CheckpointManager",
    "DamagedCheckpointError",
    "NonFiniteWeightsError",
    "_agree",
    "_capture",
    "_first",
    "check_finite_tensors",
    "read_safetensors_metadata",
    "verify_checkpoint",
]

"""Who a measured process is in its job: global rank, local rank, world size, node, and the job itself.

Multi-node jobs run on the launchers people already use, and each says it differently: torch.distributed knows
once initialised; torchrun sets RANK/LOCAL_RANK/WORLD_SIZE/GROUP_RANK; Slurm's srun sets SLURM_PROCID/SLURM_LOCALID/
SLURM_NTASKS/SLURM_NODEID for each task it starts; Open MPI's mpirun sets OMPI_COMM_WORLD_*; MPICH and Intel MPI
set PMI_RANK/PMI_SIZE. The first source that answers wins, in that order, so torchrun under srun (one srun task per
node, whose SLURM_PROCID is the node's index) still gives the training rank.

The job id keeps summaries of different jobs apart when they meet in one folder or one ``stepscope merge``: the
scheduler's job (and step), else torchrun's ``--rdzv-id``, else the rendezvous address every rank connects to.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
WORLD_VARS = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
NODE_RANK_VARS = ("GROUP_RANK", "SLURM_NODEID")


@dataclass
class Identity:
    """A process's place in its job; None where nothing says."""

    rank: int | None
    local_rank: int | None
    world_size: int | None
    node_rank: int | None
    job_id: str | None
    hostname: str
    pid: int


def _env_int(names: tuple[str, ...], env: dict[str, str]) -> int | None:
    for name in names:
        value = env.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


_seen: list[tuple[int, int]] = []  # what torch.distributed said last, while it was initialised


def _from_torch() -> tuple[int, int] | None:
    """(rank, world size) from torch.distributed when this process initialised it, or what it said while it was
    (a script that destroys its process group before it exits, as ranks started by torch.multiprocessing.spawn
    do, whose environment names no rank); None otherwise."""
    import sys

    if "torch.distributed" not in sys.modules:
        return None  # never imported: not initialised (and importing it here would cost the script time)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            _seen[:] = [(dist.get_rank(), dist.get_world_size())]
    except Exception:  # a process group being torn down: what it said before, else the launcher's word
        pass
    return _seen[0] if _seen else None


def job_id(env: dict[str, str]) -> str | None:
    """The job a process belongs to, from the launcher's environment; None when nothing names it."""
    if env.get("SLURM_JOB_ID"):
        step = env.get("SLURM_STEP_ID")
        return f"slurm:{env['SLURM_JOB_ID']}" + (f".{step}" if step else "")
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":  # torchrun's default --rdzv-id is "none": no name at all
        return f"torchrun:{run_id}"
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"rendezvous:{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    return None


def identify(env: dict[str, str] | None = None) -> Identity:
    """This process's identity now (read at the end of a run too: a script may set MASTER_ADDR or initialise
    torch.distributed only once it runs)."""
    env = dict(os.environ) if env is None else env
    rank, world = _env_int(RANK_VARS, env), _env_int(WORLD_VARS, env)
    found = _from_torch()
    if found is not None:
        rank, world = found
    return Identity(
        rank=rank,
        local_rank=_env_int(LOCAL_RANK_VARS, env),
        world_size=world,
        node_rank=_env_int(NODE_RANK_VARS, env),
        job_id=job_id(env),
        hostname=socket.gethostname(),
        pid=os.getpid(),
    )


def host_label(hostname: str) -> str:
    """A host's name as it goes into a run folder's file names: its first label, in file-safe characters."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in hostname.split(".")[0]) or "host"


def summary_name(identity: Identity) -> str:
    """The file a process writes its summary to in a run folder: unique across the nodes and processes of a job
    (and sorted by rank), ``rank00003-node7-pid4242.json``."""
    return f"rank{identity.rank or 0:05d}-{host_label(identity.hostname)}-pid{identity.pid}.json"

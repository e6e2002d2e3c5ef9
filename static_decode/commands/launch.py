"""Running under `torchrun`: detect the distributed environment, start the process group, pick each rank's
device, and let only rank 0 print.

    torchrun --nproc-per-node 2 -m static_decode generate --model CKPT --prompt "..."

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK (and MASTER_ADDR/PORT) for every process. With WORLD_SIZE > 1 the
CLI runs inside `session()`: the process group is initialised (NCCL for CUDA, gloo for the CPU), rank r uses
`cuda:LOCAL_RANK` (or the CPU), every rank loads its shard and runs the same steps, and ranks other than 0
have stdout and stderr sent to /dev/null (their errors are still printed, prefixed with the rank). Without
those variables (or with WORLD_SIZE=1) nothing here touches torch.distributed.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TextIO

import torch

from static_decode.commands.args import check_device
from static_decode.model.parallel import SINGLE, TensorParallel, open_group

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class Launch:
    """Where this process runs: its tensor-parallel place, its device and the collectives backend."""

    tp: TensorParallel  # rank / world (world 1 when not launched by torchrun)
    device: torch.device  # this rank's device
    backend: str | None  # "nccl" or "gloo" under torchrun, None in a single process
    stderr: TextIO  # the process's real stderr (errors of every rank go here)

    @property
    def is_main(self) -> bool:
        """Rank 0 (or the only process): the one that prints."""
        return self.tp.rank == 0


def distributed_env(environ: dict[str, str] | None = None) -> tuple[int, int, int] | None:
    """(rank, world, local_rank) from torchrun's variables, or None when they are absent or WORLD_SIZE is 1."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" not in env:
        return None
    try:
        rank, world, local = (int(env.get(name, "0")) for name in ENV_VARS)
    except ValueError as e:
        raise ValueError(f"torchrun variables {ENV_VARS} must be ints: {e}") from e
    if world <= 1:
        return None
    if not 0 <= rank < world or local < 0:
        raise ValueError(f"RANK={rank}, LOCAL_RANK={local} do not fit WORLD_SIZE={world}")
    return rank, world, local


def pick_device(requested: str | None, local_rank: int | None = None) -> torch.device:
    """The device of this process: `requested` (a bare "cuda" becomes cuda:LOCAL_RANK under torchrun), else
    cuda when available, else the CPU."""
    name = requested or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        return check_device(name)  # raises its one-line error naming the device string
    if device.type == "cuda" and local_rank is not None:
        if device.index is None:
            device = torch.device("cuda", local_rank)
        if device.index >= torch.cuda.device_count():
            raise ValueError(
                f"rank with LOCAL_RANK={local_rank} needs {device}, this machine has "
                f"{torch.cuda.device_count()} CUDA device(s); use --nproc-per-node <= that or --device cpu"
            )
    return check_device(str(device))  # CUDA that is not there, a backend this build lacks: one line


@contextlib.contextmanager
def session(requested_device: str | None = None) -> Iterator[Launch]:
    """The process's Launch; under torchrun (WORLD_SIZE > 1) with the process group up for the duration."""
    env = distributed_env()
    if env is None:
        yield Launch(SINGLE, pick_device(requested_device), None, sys.stderr)
        return
    import torch.distributed as dist

    rank, world, local = env
    device = pick_device(requested_device, local)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Ranks on one CPU share its cores; torch's default (every core per rank) oversubscribes them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    open_group(backend, rank, world)  # tests/commands/test_launch.py
    stdout, stderr = sys.stdout, sys.stderr
    quiet = open(os.devnull, "w") if rank != 0 else None  # noqa: SIM115 (closed in finally)
    if quiet is not None:
        sys.stdout = sys.stderr = quiet
    try:
        yield Launch(TensorParallel(rank=rank, world=world), device, backend, stderr)
    finally:
        if quiet is not None:
            sys.stdout, sys.stderr = stdout, stderr
            quiet.close()
        dist.destroy_process_group()

"""Data parallelism with ``torchrun`` (DistributedDataParallel; gloo on CPU, nccl on CUDA).

Collectives go through ``all_reduce_sum``, which puts their tensors where the backend reduces them
(CUDA under NCCL, CPU under gloo): an NCCL all-reduce of a CPU tensor fails.

Every rank holds the whole (small) module and reads its strided share of each global batch; DDP
all-reduces gradients in backward, so every rank applies the same update. Only rank 0 writes files.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1


def dist_info() -> DistInfo:
    if dist.is_available() and dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size())
    return DistInfo()


def init_from_env() -> DistInfo:
    """Join the process group torchrun describes in the environment (no-op when run plainly)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if torch.cuda.is_available():
            # one GPU per process: "cuda" (base_model.py's device "auto") then means this rank's GPU
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)
    return dist_info()


def wrap(objective: torch.nn.Module, info: DistInfo, find_unused: bool = False) -> torch.nn.Module:
    if not info.active:
        return objective
    from torch.nn.parallel import DistributedDataParallel

    # Parameters (and the normalisation buffers) are broadcast from rank 0 at construction.
    return DistributedDataParallel(objective, find_unused_parameters=find_unused)


def barrier(info: DistInfo) -> None:
    if info.active:
        dist.barrier()


def reduce_device(info: DistInfo) -> torch.device:
    """Where tensors handed to a collective must live: NCCL reduces CUDA tensors only (this rank's
    GPU, set by ``init_from_env``); gloo reduces CPU tensors."""
    if info.active and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(values: list[float], info: DistInfo) -> list[float]:
    """Sum ``values`` over ranks (float64, on the backend's device); unchanged on one process."""
    if not info.active:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=reduce_device(info))
    dist.all_reduce(t)
    return t.cpu().tolist()


def all_ranks_agree(flag: bool, info: DistInfo) -> bool:
    """True only if ``flag`` is true on every rank."""
    if not info.active:
        return flag
    return all_reduce_sum([0.0 if flag else 1.0], info)[0] == 0.0

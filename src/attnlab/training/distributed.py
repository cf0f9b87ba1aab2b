"""Set-up for ``torchrun``: one process per device, gloo on CPU, nccl on GPU.

``torchrun --nproc_per_node=N`` sets ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``; without
them everything runs in one process and these functions do nothing.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["cleanup_distributed", "init_distributed"]


def init_distributed() -> torch.device:
    """Join the process group if launched by ``torchrun``; returns this process's device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available()
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def cleanup_distributed() -> None:
    """Leave the process group (if any). Close every ``Trainer`` first (``Trainer.close``):
    a ``DistributedDataParallel`` wrapper must not outlive the group."""
    if dist.is_initialized():
        dist.destroy_process_group()

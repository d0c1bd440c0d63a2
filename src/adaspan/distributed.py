"""Where training runs: the device, this process's place in a ``torchrun`` job, and the
collective operations training needs."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist

from .errors import UserError


@dataclass(frozen=True)
class Distributed:
    """This process's place in a torchrun job (rank 0 of 1 when not distributed)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> Distributed:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size <= 1:
            return cls()
        return cls(int(os.environ["RANK"]), world_size, int(os.environ.get("LOCAL_RANK", "0")))

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def share(self, batch_size: int) -> int:
        """How many of the ``batch_size`` streams each rank trains."""
        return batch_size // self.world_size

    def rows(self, batch_size: int) -> slice:
        """This rank's contiguous share of the streams."""
        share = self.share(batch_size)
        return slice(self.rank * share, (self.rank + 1) * share)

    def barrier(self) -> None:
        if self.active:
            torch_dist.barrier()

    def agree(self, flags: list[bool], device: torch.device) -> list[bool]:
        """Each flag, true if it is true on any rank."""
        if not self.active:
            return flags
        votes = torch.tensor(flags, dtype=torch.int32, device=device)
        torch_dist.all_reduce(votes, op=torch_dist.ReduceOp.MAX)
        return [bool(v) for v in votes.tolist()]

    def mean(self, value: float, device: torch.device) -> float:
        if not self.active:
            return value
        total = torch.tensor(value, dtype=torch.float64, device=device)
        torch_dist.all_reduce(total)
        return total.item() / self.world_size

    def gather(self, obj: object) -> list:
        """``obj`` of every rank, in rank order, on rank 0 (empty list on the others)."""
        if not self.active:
            return [obj]
        gathered = [None] * self.world_size if self.is_main else None
        torch_dist.gather_object(obj, gathered, dst=0)
        return gathered or []


DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


class DeviceError(UserError, ValueError):
    """A device that is not one of auto, cpu, cuda, cuda:N, or that this machine lacks."""


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The device ``name`` (auto, cpu, cuda or cuda:N); plain ``cuda`` means GPU
    ``local_rank``."""
    if not DEVICE.fullmatch(name):
        raise DeviceError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceError(f"device {name!r} asked for, but CUDA is not available here; use cpu")
    device = torch.device("cuda", local_rank) if name == "cuda" else torch.device(name)
    if device.type == "cuda" and device.index >= torch.cuda.device_count():
        raise DeviceError(f"device {str(device)!r} asked for, but this machine has "
                          f"{torch.cuda.device_count()} CUDA device(s)")
    return device

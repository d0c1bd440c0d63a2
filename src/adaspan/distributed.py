"""This process's place in a ``torchrun`` job, and the collective operations training needs."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist


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

    def rows(self, batch_size: int) -> slice:
        """This rank's contiguous share of the streams."""
        share = batch_size // self.world_size
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

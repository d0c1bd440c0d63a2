"""Where training runs: the device, this process's place in a ``torchrun`` job, and the
collective operations training needs."""

from __future__ import annotations

import gc
import inspect
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist
from torch import Tensor

from ..config import DEVICE
from ..errors import UserError


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

    def agree(self, flags: list[bool]) -> list[bool]:
        """Each flag, true if it is true on any rank."""
        return [any(votes) for votes in zip(*self._gather(flags), strict=True)]

    def largest(self, values: list[float]) -> list[float]:
        """Each value's maximum over the ranks (numbers or flags: a flag is true on any)."""
        return [max(votes) for votes in zip(*self._gather(values), strict=True)]

    def sum(self, values: list[float]) -> list[float]:
        """Each value summed over the ranks, in rank order (Python floats: float64)."""
        return [sum(votes) for votes in zip(*self._gather(values), strict=True)]

    def mean(self, value: float) -> float:
        return self.sum([value])[0] / self.world_size

    def average(self, tensors: list[Tensor]) -> None:
        """Each tensor (of one dtype and device) replaced in place by its mean over the ranks:
        one all-reduce of them all, every rank left with the same values."""
        if not self.active:
            return
        flat = torch.cat([tensor.flatten() for tensor in tensors])
        torch_dist.all_reduce(flat)
        flat /= self.world_size
        for tensor, mean in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
            tensor.copy_(mean.view_as(tensor))

    @contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (a download, a cache filled), the other ranks after it
        (then reading what it left)."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    @contextmanager
    def joined(self, device: torch.device) -> Iterator[None]:
        """Within the block this process is in the job's process group: started (:meth:`start`)
        and destroyed at the end, unless one existed before (what holds the group, in
        reference cycles, collected first)."""
        started = self.start(device)
        try:
            yield
        finally:
            if started:
                gc.collect()
                torch_dist.destroy_process_group()

    def _gather(self, values: list) -> list[list]:
        """``values`` of every rank, in rank order. The values are the host's, and so is the
        exchange (a gloo group beside NCCL's, :func:`host_group`): no rank waits for its GPU."""
        if not self.active:
            return [values]
        gathered: list[list] = [[] for _ in range(self.world_size)]
        torch_dist.all_gather_object(gathered, values, group=host_group())
        return gathered

    def start(self, device: torch.device) -> bool:
        """Join the torchrun job's process group (nccl on CUDA, gloo on the CPU), bound to
        ``device``; False (and nothing done) when not distributed or a group already exists."""
        if not self.active or torch_dist.is_initialized():
            return False
        options = {}
        if device.type == "cuda":
            torch.cuda.set_device(device)
            if "device_id" in inspect.signature(torch_dist.init_process_group).parameters:
                options["device_id"] = device  # torch >= 2.3: NCCL set up for this GPU at once
        torch_dist.init_process_group("nccl" if device.type == "cuda" else "gloo", **options)
        host_group()  # made now, by every rank at the same point
        return True


_HOST_GROUP: list = []  # the gloo group of host values beside an NCCL one, once made


def host_group() -> torch_dist.ProcessGroup | None:
    """The process group that exchanges host values: the default one where it is gloo (CPU
    training), else a gloo group made once beside it (its collectives run on the CPU, so
    exchanging a flag never waits for a GPU's queue)."""
    if torch_dist.get_backend() == "gloo":
        return None
    if not _HOST_GROUP:
        _HOST_GROUP.append(torch_dist.new_group(backend="gloo"))
    return _HOST_GROUP[0]


class DeviceError(UserError, ValueError):
    """A device that is not one of auto, cpu, cuda, cuda:N, or that this machine lacks."""


def resolve_device(name: str, local_rank: int = 0, world_size: int = 1) -> torch.device:
    """The device ``name`` (auto, cpu, cuda or cuda:N); plain ``cuda`` means GPU
    ``local_rank``. Under torchrun (``world_size`` > 1) the local rank picks the GPU, so
    ``cuda:N`` is refused: every process would take the same one."""
    if not DEVICE.fullmatch(name):
        raise DeviceError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if world_size > 1 and ":" in name:
        raise DeviceError(f"device {name!r} cannot be used by the {world_size} processes of a "
                          "torchrun job (each takes the GPU of its LOCAL_RANK): use device=cuda "
                          "or auto")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceError(f"device {name!r} asked for, but CUDA is not available here; use cpu")
    device = torch.device("cuda", local_rank) if name == "cuda" else torch.device(name)
    if device.type == "cuda" and device.index >= torch.cuda.device_count():
        raise DeviceError(f"device {str(device)!r} asked for, but this machine has "
                          f"{torch.cuda.device_count()} CUDA device(s)")
    return device


def use_threads(threads: int | None) -> int:
    """Run torch's CPU operators on ``threads`` threads (None or 0: torch's default, one per
    core, left as it is); returns the number in use. On a machine shared with other jobs,
    cores / jobs each: more threads than free cores make every job wait for the others."""
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()

"""Counting host-device synchronisations on the CPU (imported as ``from syncs import ...``).

On CUDA, some calls make the host wait until the GPU has run everything queued before them:
reading a value (``item``, ``tolist``, ``bool``/``int``/``float`` of a tensor, ``cpu``,
``numpy``) and building a device tensor from host data (``torch.tensor``/``as_tensor`` of a
list, indexing with a Python list, ``.to(device)``). On the CPU none of them waits, but the
calls are the same, so counting them here counts the synchronisations a GPU run would make.
Only calls made outside torch's own code are counted (torch.optim's reads of its step
counters, for one, are torch's to remove).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
          torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy}
_BUILDS = {torch.tensor, torch.as_tensor}
_TORCH = str(Path(torch.__file__).parent)
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_select}


def _host_index(index: object) -> bool:
    """Whether an index holds host data that must be uploaded (a list of positions)."""
    if isinstance(index, list):
        return True
    return isinstance(index, tuple) and any(isinstance(i, list) for i in index)


def _is_sync(func: Callable, args: tuple, kwargs: dict) -> bool:
    if func in _READS:
        return True
    if func in _BUILDS:
        return not isinstance(args[0] if args else kwargs.get("data"), torch.Tensor)
    if func in _INDEXING:
        return len(args) > 1 and _host_index(args[1])
    if func is torch.Tensor.to:  # a device named: a copy between host and device on CUDA
        named = [*args[1:], kwargs.get("device")]
        return any(isinstance(a, str | torch.device) for a in named)
    return False


class SyncCounter(TorchFunctionMode):
    """Records every call that synchronises host and device on CUDA, with where it was made::

        with SyncCounter() as syncs:
            model(tokens)
        assert syncs.count <= 1, syncs.report()
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    @property
    def count(self) -> int:
        return len(self.calls)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        frame = traceback.extract_stack(limit=2)[0]
        if _is_sync(func, args, kwargs) and not frame.filename.startswith(_TORCH):
            self.calls.append(f"{getattr(func, '__name__', func)} at "
                              f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}")
        return func(*args, **kwargs)

    def report(self) -> str:
        return f"{self.count} synchronisations:\n" + "\n".join(self.calls)

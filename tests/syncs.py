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
from torch.utils._python_dispatch import TorchDispatchMode

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


class Trace(TorchDispatchMode):
    """Every operator dispatched, with its arguments' shapes, dtypes and strides (tensors) or
    values (anything else): what a CUDA graph bakes in."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.append((str(func), *map(self._describe, [*args, *kwargs.values()])))
        return func(*args, **kwargs)

    def _describe(self, arg):
        if isinstance(arg, torch.Tensor):
            return tuple(arg.shape), arg.dtype, arg.stride()
        if isinstance(arg, list | tuple):
            return tuple(map(self._describe, arg))
        return arg


def _addresses(step) -> dict[str, int]:
    """The data addresses of the static decoder's tensors and of its layers'."""
    owners = {"decoder": step, **{f"layer {i}": layer for i, layer in enumerate(step.layers)}}
    return {f"{owner}.{name}": value.data_ptr() for owner, obj in owners.items()
            for name, value in vars(obj).items() if isinstance(value, torch.Tensor)}


def assert_static_steps(model, tokens: torch.Tensor, prompt: int = 5) -> None:
    """What a CUDA graph's capture needs of :class:`adaspan.model.decode.StaticDecoder`, stepped
    through ``tokens`` after the first ``prompt``: each step reads the token from the same
    device tensor and writes the same output buffer, every operator sees the same shapes and
    arguments (no position baked in), and nothing is read from or built on the host."""
    from adaspan.model.decode import StaticDecoder

    with torch.no_grad():
        _, cache = model(tokens[None, :prompt], model.empty_cache(1, keys_values=True))
        step = StaticDecoder(model, cache, prompt)
        addresses, traces, outputs = _addresses(step), [], []
        for token in tokens[prompt:]:
            step.token.copy_(token)
            with SyncCounter() as syncs, Trace() as trace:
                outputs.append(step.step())
            assert syncs.count == 0, syncs.report()
            traces.append(trace.ops)
    assert _addresses(step) == addresses
    assert {out.data_ptr() for out in outputs} == {step.log_probs_row.data_ptr()}
    assert all(ops == traces[0] for ops in traces)

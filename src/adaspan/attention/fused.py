"""Span attention of every head of a layer in one Triton kernel (the path CUDA takes).

Each head reads its own window of keys, given as data (a tensor of windows, one per head), so a
layer runs one kernel forward and one backward however many distinct windows its heads have,
and a head scores only the keys it can see. For query t of a block of M queries after
``history`` cached positions, head h attends to the keys at distances d = 1 .. w_h (key index
``history + t - d``), with the scores of eqs. 1-2

    s_td = (q_t . k_{t-d} + q_t . p_d) / sqrt(d_head) + log m_z(d),

in one pass over tiles of keys with an online softmax (no score tile is stored): the position
scores of a tile are one product of its queries with the 2 x tile rows of p_d its distances
span, shifted into place (``tl.gather``). The backward recomputes the weights, writes the
queries' and the spans' gradients, and adds those of keys, values and p_d atomically. Dropout
(on the weights, as in the chunked path) draws its keep mask from a seed: the backward draws
the same one.

Triton is an optional dependency (``pip install adaspan[cuda]``), imported at the first call.
Tensors on the CPU run through Triton's interpreter (slow; for tests). Every kernel launch
goes through :func:`_launch`, which :func:`observe_launches` can watch (to count launches) or
replace (to count them without running the kernels).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

KERNELS = ("auto", "grouped", "fused")  # how span attention computes its heads: auto picks
# fused on CUDA with Triton installed, grouped (the band kernels of band.py) elsewhere
_observer: Callable[[str], bool] | None = None


@contextlib.contextmanager
def observe_launches(observer: Callable[[str], bool]) -> Iterator[None]:
    """Call ``observer(kernel name)`` at every kernel launch; where it returns False, the
    kernel is not run (its outputs stay unset: for counting launches only)."""
    global _observer
    previous, _observer = _observer, observer
    try:
        yield
    finally:
        _observer = previous


@functools.cache
def available() -> bool:
    """Whether a Triton with what the kernels use (``tl.gather``, Triton 3.9 tested) can be
    imported."""
    try:
        import triton.language
    except ImportError:
        return False
    return hasattr(triton.language, "gather")


@functools.cache
def _kernels() -> Any:
    """The kernel module. Without CUDA, Triton's interpreter runs them on CPU tensors: it
    must be chosen before Triton is imported (``TRITON_INTERPRET=1``), so it is set here when
    Triton was not imported yet; one process runs either the interpreter or the GPU."""
    if not torch.cuda.is_available():
        if "triton" not in sys.modules:
            os.environ["TRITON_INTERPRET"] = "1"
        elif os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("the fused kernel runs on the CPU in Triton's interpreter only, "
                               "which must be chosen before Triton is imported: set "
                               "TRITON_INTERPRET=1")
    from . import _fused_kernels

    return _fused_kernels


def _launch(name: str, grid: tuple[int, int], *args: Any, **meta: Any) -> None:
    """Launch kernel ``name`` (one launch), unless an observer says not to."""
    if _observer is not None and not _observer(name):
        return
    getattr(_kernels(), name)[grid](*args, **meta)


def _block(device: torch.device, backward: bool) -> int:
    """Queries (and keys) per tile: 16 in the interpreter, 64 forward and 32 backward on a GPU."""
    if device.type != "cuda":
        return 16
    return 32 if backward else 64


def _head_dim(d_head: int) -> int:
    """``d_head`` padded to a power of two, at least 16 (the least tile of a GPU product)."""
    return max(16, 1 << (d_head - 1).bit_length())


def _accumulator(q: Tensor) -> torch.dtype:
    """The kernels' accumulators and log-normalisers: fp64 for fp64 queries, else fp32."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _strides(t: Tensor) -> tuple[int, ...]:
    """Strides of the first three dimensions (the fourth, d_head, is contiguous)."""
    return t.stride()[:3]


def _shared_args(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, z: Tensor | None,
                 windows: Tensor, history: int, ramp: int) -> tuple[list, dict]:
    """The arguments both kernels take: q (B, H, M, dh), k and v (B, H, T, dh), the table p
    (row d - 1: p_d), z broadcast to (B, H, M) (q stands in for an absent z), the windows."""
    B, H, M, dh = q.shape
    zz = q if z is None else z.expand(B, H, M)
    args = [q, k, v, pos, zz, windows, *_strides(q), *_strides(k), *_strides(v),
            pos.stride(0), *_strides(zz), H, M, k.shape[2], pos.shape[0], history, dh,
            dh**-0.5, float(ramp)]
    return args, dict(HAS_Z=z is not None, DH=_head_dim(dh))


def forward(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, z: Tensor | None, windows: Tensor,
            history: int, ramp: int, dropout: float = 0.0, seed: Tensor | None = None
            ) -> tuple[Tensor, Tensor]:
    """Eqs. 1-3 for every head: the output (B, M, H, dh), contiguous, and each query's
    log-normaliser (B, H, M) in fp32 (fp64 for fp64 queries). q: (B, H, M, dh); k, v:
    (B, H, history + M, dh); any strides with a contiguous last dimension; pos: (>= longest
    window, dh); z: None or broadcastable to (B, H, M); windows: (H,) int32; ``seed`` (1,)
    int64: dropout's draw."""
    B, H, M, dh = q.shape
    out = q.new_empty(B, M, H, dh)
    lse = q.new_empty(B, H, M, dtype=_accumulator(q))
    args, meta = _shared_args(q, k, v, pos, z, windows, history, ramp)
    block = _block(q.device, backward=False)
    _launch("band_forward", (-(-M // block), B * H), *args, out, lse,
            *_strides(out.transpose(1, 2)), q if seed is None else seed, float(dropout),
            **meta, DROPOUT=dropout > 0, BLOCK=block)
    return out, lse


def backward(grad_out: Tensor, out: Tensor, lse: Tensor, q: Tensor,
             kv: Tensor, pos: Tensor, z: Tensor | None, windows: Tensor, history: int,
             ramp: int, dropout: float, seed: Tensor | None
             ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Gradients of q (like ``q``), of the keys and values ``kv`` (B, T, 2, H, dh), of p and
    of z ((B, H, M), or None) from that of :func:`forward`'s output, given its output and
    log-normaliser; kv, p and z in the dtype of the log-normaliser."""
    B, H, M, _ = q.shape
    grad_out = grad_out.contiguous()  # the strides of ``out``
    grad_q = torch.empty_like(q)
    grad_kv = torch.zeros_like(kv, dtype=lse.dtype)
    grad_pos = torch.zeros_like(pos, dtype=lse.dtype)
    grad_z = None if z is None else q.new_empty(B, H, M, dtype=lse.dtype)
    args, meta = _shared_args(q, *_keys_values(kv), pos, z, windows, history, ramp)
    block = _block(q.device, backward=True)
    go, grad_k = grad_out.transpose(1, 2), grad_kv[:, :, 0].transpose(1, 2)
    _launch("band_backward", (-(-M // block), B * H), *args, out.transpose(1, 2), lse, go,
            grad_q, grad_kv, grad_pos,
            lse if grad_z is None else grad_z, *_strides(go), *_strides(grad_q),
            *_strides(grad_k), grad_kv.stride(2), q if seed is None else seed, float(dropout),
            **meta, DROPOUT=dropout > 0, BLOCK=block)
    return grad_q, grad_kv, grad_pos, grad_z


def _keys_values(kv: Tensor) -> tuple[Tensor, Tensor]:
    """Keys and values (B, H, T, dh), views of ``kv`` (B, T, 2, H, dh)."""
    return kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)


class _Band(torch.autograd.Function):
    """:func:`forward`'s output and :func:`backward` as one differentiable function of q, kv,
    p and z."""

    @staticmethod
    def forward(ctx, q: Tensor, kv: Tensor, pos: Tensor, z: Tensor | None, windows: Tensor,
                history: int, ramp: int, dropout: float, seed: Tensor | None
                ) -> Tensor:
        out, lse = forward(q, *_keys_values(kv), pos, z, windows, history, ramp, dropout, seed)
        ctx.save_for_backward(q, kv, pos, z, windows, out, lse, seed)
        ctx.options = history, ramp, dropout
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, kv, pos, z, windows, out, lse, seed = ctx.saved_tensors
        history, ramp, dropout = ctx.options
        grad_q, grad_kv, grad_pos, grad_z = backward(
            grad_out, out, lse, q, kv, pos, z, windows, history, ramp, dropout, seed)
        if grad_z is not None:
            grad_z = grad_z.sum_to_size(z.shape).to(z.dtype)
        return (grad_q, grad_kv.to(kv.dtype), grad_pos.to(pos.dtype), grad_z,
                None, None, None, None, None)


def band_attention(q: Tensor, kv: Tensor | tuple[Tensor, Tensor], pos: Tensor,
                   z: Tensor | None, windows: Tensor, history: int, ramp: int,
                   dropout: float = 0.0) -> Tensor:
    """Eqs. 1-3 of every head over its own window of keys, in one kernel (one more for the
    backward): the output (B, M, H, dh).

    q: (B, H, M, dh); kv: the keys and values (B, T, 2, H, dh), T = ``history`` + M, query t
    at key index history + t; or, without gradients (inference), a pair of keys and values
    (B, H, T, dh) each; pos: the table of p_d (row d - 1), at least the longest window;
    z: None (no mask) or broadcastable to (B, H, M); windows: (H,) int32, each head's keys
    (at distances 1 .. w_h); ``dropout``: on the weights (0 outside training).
    """
    if isinstance(kv, tuple):
        return forward(q, *kv, pos, z, windows, history, ramp, dropout)[0]
    seed = (torch.randint(2**31 - 1, (1,), device=q.device) if dropout > 0 else None)
    return _Band.apply(q, kv, pos, z, windows, history, ramp, dropout, seed)

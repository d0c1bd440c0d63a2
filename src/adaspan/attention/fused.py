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

On a GPU each kernel is launched with the :class:`Config` (tile, warps, pipeline stages) that
:func:`config` gives for the device's architecture, chosen so that it fits the architecture's
shared memory (:data:`SHARED_MEMORY`) and spills no register (``scripts/gpu/gpu_compile.py``
compiles every specialization for every architecture: docs/gpu.md). fp32 products run in
fp32 unless the run allows TF32 (``torch.get_float32_matmul_precision()`` other than
``"highest"``, as the precision policy sets it). A kernel that the device cannot give its
resources raises :class:`ResourcesExceeded` in the forward pass (the backward kernel is loaded
with the first forward pass that needs it), and the attention layer takes the grouped path.

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
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

KERNELS = ("auto", "grouped", "fused")  # how span attention computes its heads: auto picks
# fused on CUDA with Triton installed, grouped (the band kernels of band.py) elsewhere
_observer: Callable[[str], bool] | None = None
_loaded: set[tuple] = set()  # backward kernels loaded on a GPU, by specialization
# The shared memory (bytes) a block may use on each NVIDIA architecture the kernels are compiled
# for: its opt-in maximum (sm_80: A100; 86: RTX 30xx, A10, A40; 89: L4, RTX 40xx; 90: H100,
# H200; 100: B200; 120: RTX 50xx)
SHARED_MEMORY = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448, 100: 232_448, 120: 101_376}


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
    with _resources(name, args[0].device):
        getattr(_kernels(), name)[grid](*args, **meta)


def _load(name: str, grid: tuple[int, int], *args: Any, **meta: Any) -> None:
    """Compile and load kernel ``name`` for these arguments on their GPU without running it."""
    with _resources(name, args[0].device):
        getattr(_kernels(), name).warmup(*args, grid=grid, **meta)[grid]


@contextlib.contextmanager
def _resources(name: str, device: torch.device) -> Iterator[None]:
    """Triton's ``OutOfResources`` (the kernel needs more shared memory, registers or
    threads than the device gives a block) raised as :class:`ResourcesExceeded`."""
    try:
        yield
    except Exception as exc:
        if type(exc).__name__ != "OutOfResources":  # Triton's, imported only with CUDA
            raise
        where = (f"{device} ({torch.cuda.get_device_name(device)}, "
                 f"sm_{''.join(map(str, torch.cuda.get_device_capability(device)))})"
                 if device.type == "cuda" else str(device))
        raise ResourcesExceeded(f"{name} on {where}: {exc}") from exc


class ResourcesExceeded(RuntimeError):
    """A kernel needs more shared memory, registers or threads than the device gives."""


@dataclass(frozen=True)
class Config:
    """How a kernel is launched: queries (and keys) per tile, warps, software-pipeline stages."""

    block: int
    num_warps: int
    num_stages: int


INTERPRETER = Config(16, 1, 1)  # on the CPU (Triton's interpreter ignores warps and stages)


def config(kernel: str, arch: int, d_head: int) -> Config:
    """The launch configuration of ``kernel`` on architecture ``arch`` (80 for sm_80, one of
    :data:`SHARED_MEMORY`) for heads of ``d_head``: it fits the architecture's shared memory
    and spills no register in every specialization the GPU runs (:func:`compiled`; fp32 in
    either precision; docs/gpu.md)."""
    if arch not in SHARED_MEMORY:
        raise ValueError(f"no configuration for sm_{arch}: one of {sorted(SHARED_MEMORY)}")
    if kernel == "band_forward" and _head_dim(d_head) <= 64:
        return Config(32, 8, 1)
    return Config(16, 8, 1)


def compiled(dtype: torch.dtype, d_head: int, precision: str, backward: bool) -> bool:
    """Whether the kernels run heads of ``dtype`` and ``d_head`` on a GPU, with products in
    ``precision`` (:func:`precision`), forward and ``backward`` too: the specializations
    that every architecture runs within its resources (``scripts/gpu/gpu_compile.py``): bf16 and
    fp16; fp32 up to 64 features (beyond, the products over the features spill registers),
    its backward with fp32 products (TF32 off) up to 32 (at 64 it spills 8 bytes with z and
    dropout on sm_90 and sm_100). On the CPU (Triton's interpreter) any run."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if dtype != torch.float32:
        return True
    limit = 32 if backward and precision == "ieee" else 64
    return _head_dim(d_head) <= limit


def _arch(device: torch.device) -> int:
    """The architecture whose configurations a CUDA device takes: its own, or the nearest
    one below it (the oldest for an older device)."""
    major, minor = torch.cuda.get_device_capability(device)
    known = [a for a in SHARED_MEMORY if a <= 10 * major + minor]
    return max(known, default=min(SHARED_MEMORY))


def _config(kernel: str, q: Tensor) -> Config:
    """The configuration of ``kernel`` for the queries' device."""
    if q.device.type != "cuda":
        return INTERPRETER
    return config(kernel, _arch(q.device), q.shape[-1])


def precision(dtype: torch.dtype, device_type: str) -> str:
    """The products' ``input_precision``: ``"tf32"`` for fp32 on CUDA where the run allows
    TF32 (``torch.get_float32_matmul_precision()`` not ``"highest"``), else ``"ieee"`` (fp32
    in fp32; 16-bit and fp64 products ignore it)."""
    tf32 = (device_type == "cuda" and dtype == torch.float32
            and torch.get_float32_matmul_precision() != "highest")
    return "tf32" if tf32 else "ieee"


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
                 windows: Tensor, history: int, ramp: int, lse: Tensor) -> tuple[list, dict]:
    """The arguments both kernels take: q (B, H, M, dh), k and v (B, H / G, T, dh) (query head
    h reads key/value head h // G), the table p (row d - 1: p_d) and z broadcast to (B, H, M),
    both in the log-normaliser's type (``lse`` stands in for an absent z), the windows."""
    B, H, M, dh = q.shape
    zz = lse if z is None else z.to(lse.dtype).expand(B, H, M)
    pos = pos.to(lse.dtype)
    args = [q, k, v, pos, zz, windows, *_strides(q), *_strides(k), *_strides(v),
            pos.stride(0), *_strides(zz), H, H // k.shape[1], M, k.shape[2], pos.shape[0],
            history, dh, dh**-0.5, float(ramp)]
    return args, dict(HAS_Z=z is not None, DH=_head_dim(dh),
                      PRECISION=precision(q.dtype, q.device.type))


def _launch_meta(config: Config, dropout: float) -> dict:
    """The constants and options of a launch with ``config`` (ptxas told it may use every
    register a thread can have: left to itself, it may hold a kernel to 128 and spill)."""
    return dict(DROPOUT=dropout > 0, BLOCK=config.block, num_warps=config.num_warps,
                num_stages=config.num_stages, maxnreg=255)


def forward_launch(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, z: Tensor | None,
                   windows: Tensor, history: int, ramp: int, dropout: float,
                   seed: Tensor | None, out: Tensor, lse: Tensor, config: Config
                   ) -> tuple[tuple[int, int], list, dict]:
    """The grid, arguments and constants (with options) of :func:`forward`'s launch, which
    writes ``out`` and ``lse``, with ``config``."""
    B, H, M, _ = q.shape
    args, meta = _shared_args(q, k, v, pos, z, windows, history, ramp, lse)
    args += [out, lse, *_strides(out.transpose(1, 2)), q if seed is None else seed,
             float(dropout)]
    return (-(-M // config.block), B * H), args, meta | _launch_meta(config, dropout)


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
    grid, args, meta = forward_launch(q, k, v, pos, z, windows, history, ramp, dropout, seed,
                                      out, lse, _config("band_forward", q))
    _launch("band_forward", grid, *args, **meta)
    return out, lse


def backward_launch(grad_out: Tensor, out: Tensor, lse: Tensor, q: Tensor, kv: Tensor,
                    pos: Tensor, z: Tensor | None, windows: Tensor, history: int, ramp: int,
                    dropout: float, seed: Tensor | None, grads: tuple, config: Config
                    ) -> tuple[tuple[int, int], list, dict]:
    """The grid, arguments and constants (with options) of :func:`backward`'s launch, which
    writes ``grads`` (those of q, kv, p and z, None for an absent z), with ``config``."""
    B, H, M, _ = q.shape
    grad_q, grad_kv, grad_pos, grad_z = grads
    args, meta = _shared_args(q, *keys_values(kv), pos, z, windows, history, ramp, lse)
    go, grad_k = grad_out.transpose(1, 2), grad_kv[:, :, 0].transpose(1, 2)
    args += [out.transpose(1, 2), lse, go, grad_q, grad_kv, grad_pos,
             lse if grad_z is None else grad_z, *_strides(go), *_strides(grad_q),
             *_strides(grad_k), grad_kv.stride(2), q if seed is None else seed, float(dropout)]
    return (-(-M // config.block), B * H), args, meta | _launch_meta(config, dropout)


def gradients(q: Tensor, kv: Tensor, pos: Tensor, z: Tensor | None, lse: Tensor) -> tuple:
    """The gradients :func:`backward` writes, allocated: q's like q; kv's, p's and z's
    ((B, H, M)) in the log-normaliser's type, zeros where added to."""
    B, H, M, _ = q.shape
    return (torch.empty_like(q), torch.zeros_like(kv, dtype=lse.dtype),
            torch.zeros_like(pos, dtype=lse.dtype),
            None if z is None else q.new_empty(B, H, M, dtype=lse.dtype))


def backward(grad_out: Tensor, out: Tensor, lse: Tensor, q: Tensor,
             kv: Tensor, pos: Tensor, z: Tensor | None, windows: Tensor, history: int,
             ramp: int, dropout: float, seed: Tensor | None
             ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Gradients of q (like ``q``), of the keys and values ``kv`` (B, T, 2, H, dh), of p and
    of z ((B, H, M), or None) from that of :func:`forward`'s output, given its output and
    log-normaliser; kv, p and z in the dtype of the log-normaliser."""
    grads = gradients(q, kv, pos, z, lse)
    grad_out = grad_out.contiguous()  # the strides of ``out``
    grid, args, meta = backward_launch(grad_out, out, lse, q, kv, pos, z, windows,
                                       history, ramp, dropout, seed, grads,
                                       _config("band_backward", q))
    _launch("band_backward", grid, *args, **meta)
    return grads


def _load_backward(out: Tensor, lse: Tensor, q: Tensor, kv: Tensor, pos: Tensor,
                   z: Tensor | None, windows: Tensor, history: int, ramp: int, dropout: float,
                   seed: Tensor | None) -> None:
    """Load the backward kernel of this forward pass on its GPU (once per specialization), so
    that one the device cannot run fails now, while the layer can still take another path."""
    key = (q.device, q.dtype, q.shape[-1], z is None, dropout > 0,
           precision(q.dtype, q.device.type))
    if q.device.type != "cuda" or _observer is not None or key in _loaded:
        return
    grid, args, meta = backward_launch(out, out, lse, q, kv, pos, z, windows, history, ramp,
                                       dropout, seed, gradients(q, kv, pos, z, lse),
                                       _config("band_backward", q))
    _load("band_backward", grid, *args, **meta)
    _loaded.add(key)


def keys_values(kv: Tensor) -> tuple[Tensor, Tensor]:
    """Keys and values (B, H, T, dh), views of ``kv`` (B, T, 2, H, dh)."""
    return kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)


class _Band(torch.autograd.Function):
    """:func:`forward`'s output and :func:`backward` as one differentiable function of q, kv,
    p and z."""

    @staticmethod
    def forward(ctx, q: Tensor, kv: Tensor, pos: Tensor, z: Tensor | None, windows: Tensor,
                history: int, ramp: int, dropout: float, seed: Tensor | None
                ) -> Tensor:
        out, lse = forward(q, *keys_values(kv), pos, z, windows, history, ramp, dropout, seed)
        _load_backward(out, lse, q, kv, pos, z, windows, history, ramp, dropout, seed)
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


def fused_attention(q: Tensor, kv: Tensor | tuple[Tensor, Tensor], pos: Tensor,
                   z: Tensor | None, windows: Tensor, history: int, ramp: int,
                   dropout: float = 0.0) -> Tensor:
    """Eqs. 1-3 of every head over its own window of keys, in one kernel (one more for the
    backward): the output (B, M, H, dh).

    q: (B, H, M, dh); kv: the keys and values (B, T, 2, H, dh), T = ``history`` + M, query t
    at key index history + t; or, without gradients (inference), a pair of keys and values
    (B, H, T, dh) each; fewer key/value heads H / G are read by G query heads each (head h
    reads h // G), and T may be less than history + M (the last key read is then T - 1;
    keys before index 0 are absent); pos: the table of p_d (row d - 1), at least the longest
    window;
    z: None (no mask) or broadcastable to (B, H, M); windows: (H,) int32, each head's keys
    (at distances 1 .. w_h); ``dropout``: on the weights (0 outside training).
    """
    if isinstance(kv, tuple):
        return forward(q, *kv, pos, z, windows, history, ramp, dropout)[0]
    seed = (torch.randint(2**31 - 1, (1,), device=q.device) if dropout > 0 else None)
    return _Band.apply(q, kv, pos, z, windows, history, ramp, dropout, seed)

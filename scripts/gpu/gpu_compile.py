"""Compile every specialization of the fused kernels (``adaspan.attention._fused_kernels``) that
the CUDA path can launch, for each NVIDIA architecture of
``adaspan.attention.fused.SHARED_MEMORY``, without a GPU, and print one JSON line per
specialization and architecture: ``arch``, ``kernel`` (``module:function``), ``signature``,
``constexprs`` and ``attrs`` (by argument name; ASTSource takes ``attrs`` keyed by ``(index in
kernel.arg_names,)``), ``num_warps``, ``num_stages``, ``shared`` (bytes, Triton's metadata),
``shared_limit``, ``registers`` and ``spill_bytes`` (ptxas's ``-v`` report: registers per
thread, bytes of spill stores), ``fits`` (within the shared memory and no spill), ``seconds``
(this compile, 0 where cached) and ``cached``.

    python scripts/gpu/gpu_compile.py                         # every specialization, every arch
    python scripts/gpu/gpu_compile.py --archs 80 --d-heads 64 --kernels band_forward

Every specialization: forward and backward; fp32 (fp32 products, and TF32 where the run allows
it), bf16 and fp16; with and without z; with and without dropout; d_head 32, 64 and 128; but
what the CUDA path does not launch (``adaspan.attention.fused.compiled``: fp32 heads of 128
features, and the backward of fp32 products in fp32 beyond 32; such a layer takes the grouped
path). The arguments are those ``adaspan.attention.fused`` builds for a launch
(``forward_launch``, ``backward_launch``), specialised by Triton's own binder as a launch would
be; the configuration is ``adaspan.attention.fused.config``. ptxas is the Triton wheel's
``ptxas-blackwell``
(Triton 3.9 writes PTX 9.4, which the wheel's older ``ptxas`` does not assemble).

Results are kept in ``--cache`` (a directory in the system's temporary directory unless given),
keyed by a hash of the kernels' source, Triton's version, ptxas's version, the architecture and
the whole specialization: a kernel changed in any way compiles again. Exit status 1 when a
line does not fit.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import io
import itertools
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

from adaspan.attention import fused

KERNELS = ("band_forward", "band_backward")
DTYPES = {"float32": ("ieee", "tf32"), "bfloat16": ("ieee",), "float16": ("ieee",)}
D_HEADS = (32, 64, 128)
MODULE = fused.__name__.rpartition(".")[0] + "._fused_kernels"  # beside adaspan.attention.fused
OPTIONS = ("num_warps", "num_stages", "maxnreg")  # the launch's options that compile passes


def example_launch(kernel: str, dtype: torch.dtype, d_head: int, has_z: bool, dropout: bool,
                   precision: str, arch: int) -> tuple[list, dict]:
    """The arguments and constants (with options) of a launch of ``kernel``, as
    ``adaspan.attention.fused`` builds them for a layer of 4 heads (a block of 64 after 64 cached
    positions; the sizes are not specialised on), under bf16/fp16 autocast for 16-bit
    ``dtype`` (p_d and z in fp32), with the products' ``precision``."""
    B, H, M, history = 2, 4, 64, 64
    q = torch.empty(B, M, H, d_head, dtype=dtype).transpose(1, 2)  # the layer's view
    kv = torch.empty(B, history + M, 2, H, d_head, dtype=dtype)
    pos = torch.empty(history, d_head)
    z = torch.empty(1, H, 1) if has_z else None
    windows = torch.empty(H, dtype=torch.int32)
    seed = torch.empty(1, dtype=torch.int64) if dropout else None
    out, lse = torch.empty(B, M, H, d_head, dtype=dtype), torch.empty(B, H, M)
    config = fused.config(kernel, arch, d_head)
    shared = (windows, history, 8, 0.1 if dropout else 0.0, seed)
    if kernel == "band_forward":
        _, args, meta = fused.forward_launch(q, *fused.keys_values(kv), pos, z, *shared, out,
                                             lse, config)
    else:
        _, args, meta = fused.backward_launch(out, out, lse, q, kv, pos, z, *shared,
                                              fused.gradients(q, kv, pos, z, lse), config)
    return args, meta | dict(PRECISION=precision)


def specializations(archs, kernels, dtypes, d_heads):
    """(arch, kernel, dtype name, precision, has_z, dropout, d_head) of every specialization
    that the CUDA path launches (``adaspan.attention.fused.compiled``)."""
    for arch, kernel, dtype, precision, d_head, has_z, dropout in itertools.product(
            archs, kernels, dtypes, ("ieee", "tf32"), d_heads, (False, True), (False, True)):
        if precision in DTYPES[dtype] and fused.compiled(getattr(torch, dtype), d_head,
                                                         precision, kernel == "band_backward"):
            yield arch, kernel, dtype, precision, has_z, dropout, d_head


def bound(kernel, args: list, meta: dict, arch: int) -> dict:
    """Signature, constexprs and attrs by argument name, and the options, of a launch with
    ``args`` and ``meta``: what Triton's binder makes of them (``triton.runtime.jit``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **meta)
    options, signature, constexprs, attrs = kernel._pack_args(backend, meta, bound_args,
                                                              specialization, options)
    names = kernel.arg_names
    return dict(signature=signature,
                constexprs={names[i]: v for (i,), v in constexprs.items()},
                attrs={names[i]: v for (i,), v in attrs.items() if v},
                num_warps=options.num_warps, num_stages=options.num_stages,
                maxnreg=options.maxnreg)


def compile_line(kernel, spec: dict, arch: int) -> dict:
    """Compile one specialization for ``arch``: shared memory, registers, spill stores."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    source = ASTSource(kernel, spec["signature"], spec["constexprs"],
                       {(names.index(n),): v for n, v in spec["attrs"].items()})
    log = io.StringIO()
    with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = True  # ptxas runs: its report is read
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                  options={k: spec[k] for k in OPTIONS})
    return dict(shared=compiled.metadata.shared, **ptxas_report(log.getvalue()))


def ptxas_report(log: str) -> dict:
    """Registers per thread and bytes of spill stores from ptxas's ``-v`` report."""
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    if registers is None or spills is None:
        raise RuntimeError(f"no ptxas report in the compiler's output:\n{log}")
    return dict(registers=int(registers.group(1)), spill_bytes=int(spills.group(1)))


def cache_key(spec: dict, arch: int, kernel_name: str) -> str:
    """What a result depends on: the kernels' source, Triton, ptxas, the specialization."""
    import triton
    from triton import knobs

    source = Path(importlib.import_module(MODULE).__file__).read_bytes()
    key = [hashlib.sha256(source).hexdigest(), triton.__version__,
           knobs.nvidia.ptxas_blackwell.version, arch, kernel_name, spec]
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def result(arch: int, kernel_name: str, args: list, meta: dict, cache: Path | None) -> dict:
    """The JSON line of one specialization on ``arch``, from the cache where it is there."""
    kernel = getattr(importlib.import_module(MODULE), kernel_name)
    spec = bound(kernel, args, meta, arch)
    path = cache / f"{cache_key(spec, arch, kernel_name)}.json" if cache else None
    line = dict(arch=arch, kernel=f"{MODULE}:{kernel_name}", **spec)
    if path is not None and path.exists():
        return line | json.loads(path.read_text()) | dict(seconds=0.0, cached=True)
    start = time.perf_counter()
    found = compile_line(kernel, spec, arch)
    found["fits"] = (found["shared"] <= fused.SHARED_MEMORY[arch]
                     and found["spill_bytes"] == 0)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(found))
        temporary.replace(path)
    return line | found | dict(seconds=round(time.perf_counter() - start, 2), cached=False)


def markdown(lines: list[dict]) -> str:
    """The lines as one table row per architecture, kernel, dtype (and precision) and d_head:
    the most shared memory, registers and spill stores over z and dropout."""
    rows: dict[tuple, list[dict]] = {}
    for line in lines:
        c, dtype = line["constexprs"], line["signature"]["Q"][1:]  # "*bf16": bf16
        if dtype == "fp32":
            dtype += f" ({c['PRECISION']})"
        key = (line["arch"], line["kernel"].rpartition(":")[2], dtype, c["DH"], c["BLOCK"],
               line["num_warps"], line["num_stages"], line["shared_limit"])
        rows.setdefault(key, []).append(line)
    table = ["| arch | kernel | dtype | d_head | block, warps, stages | shared (limit) | "
             "registers | spill bytes |", "|---|---|---|---:|---|---:|---:|---:|"]
    for (arch, kernel, dtype, d_head, block, warps, stages, limit), group in rows.items():
        worst = {k: max(line[k] for line in group)
                 for k in ("shared", "registers", "spill_bytes")}
        table.append(f"| sm_{arch} | `{kernel}` | {dtype} | {d_head} | {block}, {warps}, "
                     f"{stages} | {worst['shared']:,} ({limit:,}) | {worst['registers']} | "
                     f"{worst['spill_bytes']} |")
    return "\n".join(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default=",".join(map(str, fused.SHARED_MEMORY)))
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--d-heads", default=",".join(map(str, D_HEADS)))
    parser.add_argument("--cache", type=Path,
                        default=Path(tempfile.gettempdir()) / "adaspan-gpu-compile")
    parser.add_argument("--no-cache", action="store_true", help="compile every line again")
    parser.add_argument("--markdown", action="store_true",
                        help="a table (worst case over z and dropout) instead of JSON lines")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter's
    from triton import knobs

    # the wheel's ptxas-blackwell assembles Triton's PTX for every architecture
    os.environ.setdefault("TRITON_PTXAS_PATH", knobs.nvidia.ptxas_blackwell.path)
    cache = None if args.no_cache else args.cache
    lines = []
    for arch, kernel, dtype, precision, has_z, dropout, d_head in specializations(
            [int(a) for a in args.archs.split(",")], args.kernels.split(","),
            args.dtypes.split(","), [int(d) for d in args.d_heads.split(",")]):
        launch = example_launch(kernel, getattr(torch, dtype), d_head, has_z, dropout,
                                precision, arch)
        lines.append(dict(result(arch, kernel, *launch, cache),
                          shared_limit=fused.SHARED_MEMORY[arch]))
        if not args.markdown:
            print(json.dumps(lines[-1]), flush=True)
    if args.markdown:
        print(markdown(lines))
    return 0 if all(line["fits"] for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Other routes to the banded attention of evaluation (eqs. 1-3, forward only), each checked
against :func:`adaspan.attention.banded_attention` and timed against it, alternating, in one
process: PyTorch's fused CPU attention (``scaled_dot_product_attention`` with the position
scores and the band as a float mask), FlexAttention compiled with ``torch.compile`` (a block
mask for the band, a ``score_mod`` for the position scores and ``log m_z``), and a small C++
kernel (one pass per chunk: two BLAS products, the band's softmax, one product with the values), and
the same band softmax alone between two batched products.

    pip install ninja   # the C++ kernel is built with torch.utils.cpp_extension
    python scripts/attention_routes.py [--routes sdpa,flex,cpp,cpp-softmax] [--windows 64,...] \\
        [--repeats 5]

None of these routes is used by adaspan (docs/performance.md gives the measured reasons); this
script keeps the measurement reproducible. Prints one JSON line per window: the largest
difference from ``banded_attention``, and the median milliseconds of each route over
``--repeats`` alternations (each the median of 9 calls).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F

from adaspan import attention
from adaspan.bench import seconds

RAMP, BATCH, BLOCK, D_HEAD = 32, 8, 256, 64
HEADS = {64: 4, 128: 1, 256: 2, 512: 1, 1024: 1, 4096: 1}  # a head group of each window


def band_bias(q: torch.Tensor, pos: torch.Tensor, z: torch.Tensor, c: int) -> torch.Tensor:
    """(B, H, n, c, w + c - 1) additive mask of each chunk: position scores and log m_z in the
    band (query i of a chunk sees its keys i .. i + w - 1), -inf elsewhere. ``q`` is scaled,
    ``z`` broadcastable to (B, H, n, c, 1)."""
    w = pos.shape[0]
    position = q @ pos.flip(0).t()  # (B, H, n, c, w), column j: distance w - j
    log_mask = attention.log_soft_mask(torch.arange(w, 0, -1, dtype=q.dtype), z, RAMP)
    bias = position.new_full((*position.shape[:-1], w + c - 1), -math.inf)
    attention._band(bias, w).copy_(position + log_mask)
    return bias


def chunks(q, k, v, pos) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """As banded_attention splits them (``c`` must divide the block): the scaled queries
    (B, H, n, c, dh), the key and value windows (B, H, n, w + c - 1, dh), and ``c``."""
    (M, dh), w = q.shape[2:], pos.shape[0]
    c = attention.chunk_size(M, w)
    n = M // c
    k_win, v_win = (attention._windows(t, w + c - 1, c, n) for t in (k, v))
    return (q * dh**-0.5).unflatten(2, (n, c)), k_win, v_win, c


def sdpa_route(q, k, v, pos, z):
    """Chunks as in banded_attention, each through scaled_dot_product_attention."""
    H = q.shape[1]
    qs, k_win, v_win, c = chunks(q, k, v, pos)
    n = qs.shape[2]
    windows = [t.flatten(1, 2) for t in (k_win, v_win)]
    bias = band_bias(qs, pos, z[..., None, None], c).flatten(1, 2)
    out = F.scaled_dot_product_attention(qs.flatten(1, 2), *windows, attn_mask=bias, scale=1.0)
    return out.unflatten(1, (H, n)).flatten(2, 3)


def flex_route(w: int, H: int):
    """FlexAttention for one window and head count, compiled once (for these shapes)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def band(b, h, q_idx, kv_idx):  # query t sits at key index w + t: distances 1 .. w
        return (w + q_idx - kv_idx >= 1) & (w + q_idx - kv_idx <= w)

    torch.compiler.reset()  # a fresh compile per window, as in a process of its own
    block_mask = create_block_mask(band, None, None, BLOCK, w + BLOCK, device="cpu")
    compiled = torch.compile(flex_attention)

    def run(q, k, v, pos, z):
        position = (q * q.shape[-1] ** -0.5) @ pos.t()  # column d - 1: distance d
        distance = torch.arange(1, w + 1, dtype=q.dtype)
        log_mask = attention.log_soft_mask(distance, z.view(H, 1), RAMP)

        def score_mod(score, b, h, q_idx, kv_idx):
            d = (w + q_idx - kv_idx).clamp(1, w) - 1
            return score + position[b, h, q_idx, d] + log_mask[h, d]

        return compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)

    return run


CPP = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

extern "C" void sgemm_(const char*, const char*, const int*, const int*, const int*,
                       const float*, const float*, const int*, const float*, const int*,
                       const float*, float*, const int*);

// Row-major C (m x n) = op(A) op(B), through the column-major BLAS that torch links.
static void gemm(bool ta, bool tb, int m, int n, int k, const float* a, int lda,
                 const float* b, int ldb, float* c, int ldc) {
  const char opa = ta ? 'T' : 'N', opb = tb ? 'T' : 'N';
  const float one = 1.0f, zero = 0.0f;
  sgemm_(&opb, &opa, &n, &m, &k, &one, b, &ldb, a, &lda, &zero, c, &ldc);
}

// q (BH, M, dh) scaled; k, v (BH, w + M, dh); pos_flip (w, dh); log_mask (BH, w).
torch::Tensor band_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                           torch::Tensor pos_flip, torch::Tensor log_mask, int64_t c) {
  q = q.contiguous(), k = k.contiguous(), v = v.contiguous();
  pos_flip = pos_flip.contiguous(), log_mask = log_mask.contiguous();
  const int BH = q.size(0), M = q.size(1), dh = q.size(2), w = pos_flip.size(0);
  const int n = (M + c - 1) / c, L = w + c - 1, T = k.size(1);
  auto out = torch::empty_like(q);
  const float *Q = q.data_ptr<float>(), *K = k.data_ptr<float>(), *V = v.data_ptr<float>();
  const float *P = pos_flip.data_ptr<float>(), *LM = log_mask.data_ptr<float>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, BH * n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> S((size_t)c * L), Ps((size_t)c * w);
    for (int64_t task = begin; task < end; ++task) {
      const int bh = task / n, q0 = (task % n) * c, rows = std::min<int>(c, M - q0);
      const int keys = std::min(L, T - q0);
      const float* Qc = Q + ((size_t)bh * M + q0) * dh;
      const float* lm = LM + (size_t)bh * w;
      gemm(false, true, rows, keys, dh, Qc, dh, K + ((size_t)bh * T + q0) * dh, dh, S.data(), L);
      gemm(false, true, rows, w, dh, Qc, dh, P, dh, Ps.data(), w);
      for (int r = 0; r < rows; ++r) {
        float *s = S.data() + (size_t)r * L, *band = s + r, mx = -INFINITY, sum = 0.0f;
        const float* p = Ps.data() + (size_t)r * w;
        for (int j = 0; j < w; ++j) { band[j] += p[j] + lm[j]; mx = std::max(mx, band[j]); }
        for (int j = 0; j < w; ++j) { band[j] = std::exp(band[j] - mx); sum += band[j]; }
        for (int j = 0; j < w; ++j) band[j] /= sum;
        for (int j = 0; j < r; ++j) s[j] = 0.0f;
        for (int j = r + w; j < keys; ++j) s[j] = 0.0f;
      }
      gemm(false, false, rows, dh, keys, S.data(), L, V + ((size_t)bh * T + q0) * dh, dh,
           O + ((size_t)bh * M + q0) * dh, dh);
    }
  });
  return out;
}

// Only the band's softmax, in place, between two batched products: row r of each tile of
// scores (N, c, L) becomes softmax(scores[r, r + j] + position[r, j] + log_mask[j]) in its
// band (j < w), 0 elsewhere. position (N, c, w); log_mask (N, w).
void band_softmax_(torch::Tensor scores, torch::Tensor position, torch::Tensor log_mask) {
  position = position.contiguous(), log_mask = log_mask.contiguous();
  const int64_t N = scores.size(0), c = scores.size(1), L = scores.size(2), w = position.size(2);
  float* S = scores.data_ptr<float>();
  const float *P = position.data_ptr<float>(), *LM = log_mask.data_ptr<float>();
  at::parallel_for(0, N * c, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t r = row % c;
      float *s = S + row * L, *band = s + r, mx = -INFINITY, sum = 0.0f;
      const float *p = P + row * w, *lm = LM + (row / c) * w;
      for (int64_t j = 0; j < w; ++j) { band[j] += p[j] + lm[j]; mx = std::max(mx, band[j]); }
      for (int64_t j = 0; j < w; ++j) { band[j] = std::exp(band[j] - mx); sum += band[j]; }
      for (int64_t j = 0; j < w; ++j) band[j] /= sum;
      for (int64_t j = 0; j < r; ++j) s[j] = 0.0f;
      for (int64_t j = r + w; j < L; ++j) s[j] = 0.0f;
    }
  });
}
"""


def cpp_routes() -> dict:
    """The C++ kernels, built once (torch.utils.cpp_extension; needs ninja and a compiler):
    the whole attention per chunk ("cpp"), and only the band's softmax between two batched
    products ("cpp-softmax")."""
    from torch.utils.cpp_extension import load_inline

    ext = load_inline("adaspan_band_probe", CPP, functions=["band_forward", "band_softmax_"],
                      extra_cflags=["-O3", "-march=native", "-fopenmp"],
                      extra_ldflags=["-fopenmp"])

    def whole(q, k, v, pos, z):
        (B, H, M, dh), w = q.shape, pos.shape[0]
        distance = torch.arange(w, 0, -1, dtype=q.dtype)
        log_mask = attention.log_soft_mask(distance, z.view(H, 1), RAMP).expand(B, H, w)
        out = ext.band_forward((q * dh**-0.5).flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                               pos.flip(0).contiguous(), log_mask.reshape(B * H, w),
                               attention.chunk_size(M, w))
        return out.view(B, H, M, dh)

    def softmax_only(q, k, v, pos, z):
        (B, H, M, dh), w = q.shape, pos.shape[0]
        qs, k_win, v_win, _ = chunks(q, k, v, pos)
        n = qs.shape[2]
        distance = torch.arange(w, 0, -1, dtype=q.dtype)
        log_mask = attention.log_soft_mask(distance, z.view(H, 1), RAMP)[None, :, None]
        k_win, v_win = k_win.flatten(0, 2), v_win.flatten(0, 2)
        scores = qs.flatten(0, 2) @ k_win.transpose(-1, -2)
        ext.band_softmax_(scores, (qs @ pos.flip(0).t()).flatten(0, 2),
                          log_mask.expand(B, H, n, w).reshape(-1, w))
        return (scores @ v_win).view(B, H, M, dh)

    return {"cpp": whole, "cpp-softmax": softmax_only}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--routes", default="sdpa,flex,cpp,cpp-softmax")
    parser.add_argument("--windows", default=",".join(map(str, HEADS)))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    routes = args.routes.split(",")
    compiled = cpp_routes() if {"cpp", "cpp-softmax"} & set(routes) else {}
    torch.manual_seed(0)
    for w in map(int, args.windows.split(",")):
        H = HEADS.get(w, 1)
        q = torch.randn(BATCH, H, BLOCK, D_HEAD)
        k, v = (torch.randn(BATCH, H, w + BLOCK, D_HEAD) for _ in range(2))
        pos, z = torch.randn(w, D_HEAD), torch.full((1, H, 1), w - 40.0)
        inputs = (q, k, v, pos, z)
        runs = {"banded_attention": lambda *a: attention.banded_attention(*a, RAMP)}
        if "sdpa" in routes:
            runs["sdpa"] = sdpa_route
        runs.update({name: fn for name, fn in compiled.items() if name in routes})
        if "flex" in routes:
            start = time.perf_counter()
            runs["flex"] = flex_route(w, H)
            with torch.no_grad():
                runs["flex"](*inputs)
            compile_s = time.perf_counter() - start
        with torch.no_grad():
            reference = runs["banded_attention"](*inputs)
            error = {name: (fn(*inputs) - reference).abs().max().item()
                     for name, fn in runs.items() if name != "banded_attention"}
            times = {name: [] for name in runs}
            for _ in range(args.repeats):
                for name, fn in runs.items():
                    times[name].append(1e3 * seconds(lambda fn=fn, a=inputs: fn(*a), 9, None))
        row = {"window": w, "heads": H, "max_abs_error": error,
               "ms": {name: statistics.median(t) for name, t in times.items()}}
        if "flex" in routes:
            row["flex_first_call_s"] = compile_s
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

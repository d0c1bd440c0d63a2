"""The Triton kernels of :mod:`adaspan.attention.fused` (imported only there, at the first call: it
imports Triton, an optional dependency).

Program (i, b * H + h) handles queries i * BLOCK .. (i + 1) * BLOCK - 1 of head h of sequence
b and loops over the tiles of the keys they can see, ``history + t - w_h`` to
``history + t - 1`` for query t (of key/value head h // G; keys before index 0 absent): the
loop's bounds follow the head's window w_h, read from ``WIN``. Pointers are (b, h, position)
strides plus a contiguous last dimension of ``dh`` (padded to ``DH``); z has (b, h, t)
strides, 0 where it is broadcast. The sizes and z's strides are not specialised on their values
(``do_not_specialize``: a head count or a stride of 1 would compile another kernel); the other
strides are, on their divisibility by 16. ``PRECISION`` is the
``input_precision`` of every product (``"ieee"``: fp32 products in fp32; ``"tf32"``: TF32 on
the tensor cores; ignored for 16-bit inputs).

The position scores of a tile (queries i, keys j) read p_d at the 2 BLOCK - 1 distances
``first + i - j + BLOCK - 1``: two products of the queries with BLOCK rows of p_d each (the
nearer half from ``first``, the farther from ``first + BLOCK``), each skewed into the tile's
(query, key) layout (:func:`_skew`), so that no product holds more than BLOCK rows of p_d.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _skew(x, OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    """``y[i, j] = x[i, i - j + OFFSET]`` where that column is in the tile, else 0: the
    position scores of a half of p_d into (query, key) layout (OFFSET BLOCK - 1 for the
    nearer half, -1 for the farther), or their gradients back (the map is its own inverse)."""
    i = tl.arange(0, BLOCK)[:, None]
    c = i - tl.arange(0, BLOCK)[None, :] + OFFSET
    inside = (c >= 0) & (c < BLOCK)
    return tl.where(inside, tl.gather(x, tl.minimum(tl.maximum(c, 0), BLOCK - 1), 1), 0.0)


@triton.jit
def _position_rows(POS, first, spd, n_pos, dh, dtype, DH: tl.constexpr, BLOCK: tl.constexpr):
    """Rows ``first`` .. ``first + BLOCK - 1`` of p_d (0 outside the table), as ``dtype``."""
    dd = first + tl.arange(0, BLOCK)
    e = tl.arange(0, DH)
    p = tl.load(POS + (dd[:, None] - 1) * spd + e[None, :],
                mask=(dd[:, None] >= 1) & (dd[:, None] <= n_pos) & (e[None, :] < dh), other=0.0)
    return p.to(dtype)


@triton.jit
def _key_rows(X, base, r, stride, T, dh, DH: tl.constexpr):
    """Rows ``r`` of a head's keys or values (``X + base``, rows ``stride`` apart; 0 outside
    the sequence and beyond ``dh``)."""
    e = tl.arange(0, DH)
    return tl.load(X + base + r[:, None] * stride + e[None, :],
                   mask=(r[:, None] >= 0) & (r[:, None] < T) & (e[None, :] < dh), other=0.0)


@triton.jit
def _scores(q, K, POS, kb, skt, spd, z, start, r0, history, w, T, n_pos, dh, scale, ramp,
            HAS_Z: tl.constexpr, DH: tl.constexpr, BLOCK: tl.constexpr,
            PRECISION: tl.constexpr):
    """The tile of scores s_tr (eqs. 1-2) of queries ``start`` .. ``start + BLOCK - 1``
    against keys r0 .. r0 + BLOCK - 1, -inf where the key is out of the head's window or its
    mask is 0; with the first row of p_d the tile reads, the masks m_z and where the tile is
    valid. (The backward loads the keys and p_d again where it needs them: held from here,
    they would stay in registers through the whole tile.)"""
    t = start + tl.arange(0, BLOCK)
    r = r0 + tl.arange(0, BLOCK)
    k = _key_rows(K, kb, r, skt, T, dh, DH)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    first = history + start - r0 - BLOCK + 1
    near = _position_rows(POS, first, spd, n_pos, dh, q.dtype, DH, BLOCK)
    s += _skew(tl.dot(q, tl.trans(near), input_precision=PRECISION), BLOCK - 1, BLOCK)
    far = _position_rows(POS, first + BLOCK, spd, n_pos, dh, q.dtype, DH, BLOCK)
    s = (s + _skew(tl.dot(q, tl.trans(far), input_precision=PRECISION), -1, BLOCK)) * scale
    d = history + t[:, None] - r[None, :]
    valid = (d >= 1) & (d <= w) & (r[None, :] >= 0)  # keys before the sequence are absent
    m = tl.full((BLOCK, BLOCK), 1.0, z.dtype)
    if HAS_Z:
        m = (ramp + z[:, None] - d) / ramp
        valid = valid & (m > 0)
        s = s + tl.log(tl.minimum(tl.maximum(m, 1e-30), 1.0))
    s = tl.where(valid, s, float("-inf"))
    return s, first, m, valid


@triton.jit
def _keep(SEED, bh, t, r, T, p_drop, BLOCK: tl.constexpr):
    """Dropout's keep mask of the tile (drawn again alike by the backward)."""
    seed = tl.load(SEED)
    return tl.rand(seed + bh, t[:, None] * T + r[None, :]) >= p_drop


@triton.jit
def _tile(Q, Z, WIN, LSE, sqb, sqh, sqt, szb, szh, szt, H, M, dh, DH: tl.constexpr,
          BLOCK: tl.constexpr):
    """This program's tile: batch b, head h and its window w, the first query ``start``, the
    query positions t, the feature index e, the valid (query, feature) entries, the queries
    and their z (in the accumulators' type). Its keys and values are those of head h // G
    (G query heads per key/value head)."""
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    w = tl.load(WIN + h)
    start = tl.program_id(0) * BLOCK
    t = start + tl.arange(0, BLOCK)
    e = tl.arange(0, DH)
    rows = (t[:, None] < M) & (e[None, :] < dh)
    q = tl.load(Q + b * sqb + h * sqh + t[:, None] * sqt + e[None, :], mask=rows, other=0.0)
    z = tl.load(Z + b * szb + h * szh + t * szt, mask=t < M, other=0.0)
    return b, h, w, start, t, e, rows, q, z.to(LSE.dtype.element_ty)


# arguments whose values vary from launch to launch, with no gain from specialising on them
_VARYING = ("szb", "szh", "szt", "H", "G", "M", "T", "n_pos", "history")


@triton.jit(do_not_specialize=_VARYING)
def band_forward(Q, K, V, POS, Z, WIN, sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, spd,
                 szb, szh, szt, H, G, M, T, n_pos, history, dh, scale, ramp,
                 OUT, LSE, sob, soh, sot, SEED, p_drop,
                 HAS_Z: tl.constexpr, DH: tl.constexpr, DROPOUT: tl.constexpr,
                 BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    """Output and log-normaliser of a tile of queries of one head (online softmax)."""
    bh = tl.program_id(1)
    b, h, w, start, t, e, rows, q, z = _tile(Q, Z, WIN, LSE, sqb, sqh, sqt, szb, szh, szt, H,
                                             M, dh, DH, BLOCK)
    acc_type = LSE.dtype.element_ty  # fp32, or fp64 for fp64 inputs
    top = tl.full((BLOCK,), -1e30, acc_type)
    total = tl.zeros((BLOCK,), acc_type)
    acc = tl.zeros((BLOCK, DH), acc_type)
    for r0 in range(history + start - w, history + start + BLOCK - 1, BLOCK):
        s = _scores(q, K, POS, b * skb + (h // G) * skh, skt, spd, z, start, r0, history, w,
                    T, n_pos, dh, scale, ramp, HAS_Z, DH, BLOCK, PRECISION)[0]
        new_top = tl.maximum(top, tl.max(s, 1))
        alpha = tl.exp(top - new_top)
        weights = tl.exp(s - new_top[:, None])
        total = total * alpha + tl.sum(weights, 1)
        r = r0 + tl.arange(0, BLOCK)
        if DROPOUT:
            keep = _keep(SEED, bh, t, r, T, p_drop, BLOCK)
            weights = tl.where(keep, weights / (1.0 - p_drop), 0.0)
        v = _key_rows(V, b * svb + (h // G) * svh, r, svt, T, dh, DH)
        acc = acc * alpha[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
        top = new_top
    out = acc / total[:, None]
    tl.store(OUT + b * sob + h * soh + t[:, None] * sot + e[None, :], out.to(OUT.dtype.element_ty),
             mask=rows)
    tl.store(LSE + (b * H + h) * M + t, top + tl.log(total), mask=t < M)


@triton.jit
def _add_position_rows(GPOS, first, grad, spd, n_pos, dh, DH: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Add ``grad`` to rows ``first`` .. ``first + BLOCK - 1`` of p_d's gradient (atomically;
    rows outside the table are left out)."""
    dd = first + tl.arange(0, BLOCK)
    e = tl.arange(0, DH)
    tl.atomic_add(GPOS + (dd[:, None] - 1) * spd + e[None, :], grad,
                  mask=(dd[:, None] >= 1) & (dd[:, None] <= n_pos) & (e[None, :] < dh))


@triton.jit
def _position_gradients(grad_s, q, POS, GPOS, first, spd, n_pos, dh, DH: tl.constexpr,
                        BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    """The gradient of a tile's position scores, back in the two halves of p_d it read (from
    ``first``): added to p_d's gradient atomically; returns the queries' share."""
    grad_near = _skew(grad_s, BLOCK - 1, BLOCK).to(q.dtype)
    grad_far = _skew(grad_s, -1, BLOCK).to(q.dtype)
    _add_position_rows(GPOS, first, tl.dot(tl.trans(grad_near), q, input_precision=PRECISION),
                       spd, n_pos, dh, DH, BLOCK)
    _add_position_rows(GPOS, first + BLOCK,
                       tl.dot(tl.trans(grad_far), q, input_precision=PRECISION),
                       spd, n_pos, dh, DH, BLOCK)
    near = _position_rows(POS, first, spd, n_pos, dh, q.dtype, DH, BLOCK)
    grad_q = tl.dot(grad_near, near, input_precision=PRECISION)
    far = _position_rows(POS, first + BLOCK, spd, n_pos, dh, q.dtype, DH, BLOCK)
    return grad_q + tl.dot(grad_far, far, input_precision=PRECISION)


@triton.jit(do_not_specialize=_VARYING)
def band_backward(Q, K, V, POS, Z, WIN, sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, spd,
                  szb, szh, szt, H, G, M, T, n_pos, history, dh, scale, ramp,
                  OUT, LSE, GO, GQ, GK, GPOS, GZ, sgb, sgh, sgt, sdb, sdh, sdt,
                  sgkb, sgkh, sgkt, sgv, SEED, p_drop,
                  HAS_Z: tl.constexpr, DH: tl.constexpr, DROPOUT: tl.constexpr,
                  BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    """Gradients of a tile of queries of one head: written for q and z, added atomically
    for k and v (the gradient of v ``sgv`` after that of k, with the same strides) and p_d.
    OUT shares the strides of GO."""
    bh = tl.program_id(1)
    b, h, w, start, t, e, rows, q, z = _tile(Q, Z, WIN, LSE, sqb, sqh, sqt, szb, szh, szt, H,
                                             M, dh, DH, BLOCK)
    acc_type = LSE.dtype.element_ty  # fp32, or fp64 for fp64 inputs
    go = tl.load(GO + b * sgb + h * sgh + t[:, None] * sgt + e[None, :], mask=rows, other=0.0)
    o = tl.load(OUT + b * sgb + h * sgh + t[:, None] * sgt + e[None, :], mask=rows, other=0.0)
    lse = tl.load(LSE + bh * M + t, mask=t < M, other=0.0)
    delta = tl.sum(go.to(acc_type) * o.to(acc_type), 1)  # sum_r a_tr dA_tr
    grad_q = tl.zeros((BLOCK, DH), acc_type)
    grad_z = tl.zeros((BLOCK,), acc_type)
    for r0 in range(history + start - w, history + start + BLOCK - 1, BLOCK):
        s, first, m, valid = _scores(q, K, POS, b * skb + (h // G) * skh, skt, spd, z, start,
                                     r0, history, w, T, n_pos, dh, scale, ramp, HAS_Z, DH,
                                     BLOCK, PRECISION)
        r = r0 + tl.arange(0, BLOCK)
        keys = (r[:, None] >= 0) & (r[:, None] < T) & (e[None, :] < dh)
        weights = tl.exp(s - lse[:, None])
        v = _key_rows(V, b * svb + (h // G) * svh, r, svt, T, dh, DH)
        grad_weights = tl.dot(go, tl.trans(v), input_precision=PRECISION)
        dropped = weights
        if DROPOUT:
            keep = _keep(SEED, bh, t, r, T, p_drop, BLOCK)
            dropped = tl.where(keep, weights / (1.0 - p_drop), 0.0)
            grad_weights = tl.where(keep, grad_weights / (1.0 - p_drop), 0.0)
        key_rows = GK + b * sgkb + (h // G) * sgkh + r[:, None] * sgkt + e[None, :]
        tl.atomic_add(key_rows + sgv,
                      tl.dot(tl.trans(dropped.to(go.dtype)), go, input_precision=PRECISION),
                      mask=keys)
        grad_s = weights * (grad_weights - delta[:, None])  # d loss / d s_tr
        if HAS_Z:  # d log m / dz = 1 / (R m) where 0 < m < 1 (0 at the kinks, as band.py)
            ramp_m = ramp * tl.maximum(m, 1e-30)
            grad_z += tl.sum(tl.where(valid & (m < 1.0), grad_s / ramp_m, 0.0), 1)
        grad_s = grad_s * scale
        k = _key_rows(K, b * skb + (h // G) * skh, r, skt, T, dh, DH)
        grad_q += tl.dot(grad_s.to(k.dtype), k, input_precision=PRECISION)
        tl.atomic_add(key_rows, tl.dot(tl.trans(grad_s.to(q.dtype)), q, input_precision=PRECISION),
                      mask=keys)
        grad_q += _position_gradients(grad_s, q, POS, GPOS, first, spd, n_pos, dh, DH, BLOCK,
                                      PRECISION)
    tl.store(GQ + b * sdb + h * sdh + t[:, None] * sdt + e[None, :],
             grad_q.to(GQ.dtype.element_ty), mask=rows)
    if HAS_Z:
        tl.store(GZ + bh * M + t, grad_z, mask=t < M)

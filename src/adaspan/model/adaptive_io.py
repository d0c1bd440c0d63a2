"""Adaptive input (Baevski & Auli 2018) and adaptive softmax (Grave et al. 2017), for
vocabularies too large for one (V, d) embedding and one (V, d) output matrix.

Cutoffs ``c_1 < ... < c_k`` split the vocabulary [0, V) into clusters: cluster 0 = [0, c_1)
(the head, or shortlist), cluster i = [c_i, c_{i+1}) with c_{k+1} = V. Cluster i has the
dimension d_i = d // div_val**i (d = d_model), an embedding matrix E_i (n_i, d_i) and a
projection P_i (d, d_i), so rare tokens cost fewer parameters and products:

    input:   x_t = sqrt(d) P_i E_i[t - c_i]                          (t in cluster i)
    head:    z_0 = (h P_0) [W_0; C]^T + [b_0; b_C]                   (n_0 + k logits)
    tail i:  z_i = (h P_i) W_i^T + b_i                               (n_i logits)
    log p(t) = log softmax(z_0)[t]                                    (t in the head)
    log p(t) = log softmax(z_0)[n_0 + i - 1] + log softmax(z_i)[t - c_i]  (t in cluster i)

Row ``i - 1`` of C (``cluster.weight``) and ``b_C`` (``cluster.bias``) is the logit of tail
cluster i (the authors' head puts it at column ``-i``, row ``k - i`` of their
``cluster_proj``: reversed). Tied (``tie_io``, the default; the authors' ``adapt_io_tied``),
W_i = E_i and the output's P_i is the input's: the softmax reads the input module's
parameters and owns only its biases and C.
With no cutoffs (one cluster) the softmax is a plain softmax over ``(h P_0) W_0^T + b_0``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Clusters:
    """The split of [0, V) by ``cutoffs`` and each cluster's dimension ``d // div_val**i``."""

    def __init__(self, vocab_size: int, d_model: int, cutoffs: Sequence[int] = (),
                 div_val: int = 4) -> None:
        cutoffs = tuple(int(c) for c in cutoffs)
        bounds = (0, *cutoffs, vocab_size)
        if not all(a < b for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"cutoffs must increase within (0, {vocab_size}), got {cutoffs}")
        if div_val < 1 or d_model // div_val ** len(cutoffs) < 1:
            raise ValueError(f"div_val={div_val} leaves a cluster without dimensions")
        self.vocab_size, self.d_model, self.cutoffs, self.div_val = (vocab_size, d_model,
                                                                     cutoffs, div_val)
        self.starts = (0, *cutoffs)
        self.sizes = tuple(b - a for a, b in zip(self.starts, (*cutoffs, vocab_size), strict=True))
        self.dims = tuple(d_model // div_val**i for i in range(len(self.sizes)))

    def __len__(self) -> int:
        return len(self.sizes)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Clusters) and vars(self) == vars(other)

    def of(self, ids: Tensor) -> Tensor:
        """The cluster of every id (same shape, int64): how many cutoffs are <= it."""
        cluster = torch.zeros_like(ids)
        for c in self.cutoffs:
            cluster += ids >= c
        return cluster

    def members(self, cluster: Tensor) -> list[Tensor]:
        """Per cluster, the positions of the flat ``cluster`` ids in it (possibly none): one
        stable sort and one host read of the counts (the only host-device synchronisation:
        counted by ``scatter_add_``, since ``torch.bincount`` on CUDA reads the maximum first)."""
        order = torch.argsort(cluster, stable=True)
        counts = cluster.new_zeros(len(self)).scatter_add_(0, cluster, torch.ones_like(cluster))
        counts = counts.tolist()
        return list(order.split(counts))

    def flops(self) -> int:
        """Multiply-adds per token of the full distribution (:meth:`AdaptiveSoftmax.log_probs`):
        the head ``d d_0 + d_0 (n_0 + k)``, each tail ``d d_i + d_i n_i``."""
        d, k = self.d_model, len(self) - 1
        return sum(d * d_i + d_i * (n_i + (k if i == 0 else 0))
                   for i, (n_i, d_i) in enumerate(zip(self.sizes, self.dims, strict=True)))


def at_least_float32(x: Tensor) -> Tensor:
    """``x`` in float32, unless it is float64 already (logits before their log-softmax)."""
    return x if x.dtype == torch.float64 else x.float()


def _projection(d_model: int, d_i: int) -> nn.Parameter:
    """A (d_model, d_i) matrix initialised as ``nn.Linear(d_i, d_model).weight`` (what the
    authors use): U(-1/sqrt(d_i), 1/sqrt(d_i))."""
    weight = nn.Parameter(torch.empty(d_model, d_i))
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    return weight


class AdaptiveInput(nn.Module):
    """Adaptive input representations (Baevski & Auli 2018, §3): token t of cluster i is
    ``sqrt(d_model) P_i E_i[t - c_i]``, scaled by sqrt(d_model) as in the authors' code.
    Init: E_i ~ N(0, 1/d_i) (Baevski & Auli's; the authors' code keeps ``nn.Embedding``'s
    N(0, 1), whose tied output starts at logits of norm ~sqrt(d) and a loss of several times
    log V: training then stops as diverged at its first record), P_i as
    ``nn.Linear(d_i, d_model).weight``. A converted checkpoint brings its own values."""

    def __init__(self, vocab_size: int, d_model: int, cutoffs: Sequence[int] = (),
                 div_val: int = 4) -> None:
        super().__init__()
        self.clusters = Clusters(vocab_size, d_model, cutoffs, div_val)
        sizes, dims = self.clusters.sizes, self.clusters.dims
        self.embeddings = nn.ModuleList(nn.Embedding(n, d)
                                        for n, d in zip(sizes, dims, strict=True))
        for embedding, d in zip(self.embeddings, dims, strict=True):
            nn.init.normal_(embedding.weight, 0.0, d**-0.5)
        self.projections = nn.ParameterList(_projection(d_model, d) for d in dims)
        self.scale = math.sqrt(d_model)

    def forward(self, ids: Tensor) -> Tensor:
        """Embeddings (..., d_model) of ``ids`` (any shape), in the parameters' dtype.

        One masked pass per cluster: every position is looked up in every cluster (its id
        clamped into the cluster), projected, and kept where the id belongs, with
        ``torch.where``. No host-device synchronisation (no boolean indexing, whose
        ``nonzero`` would wait for the device) and static shapes, at the cost of projecting
        each token through every P_i (``d sum_i d_i`` multiply-adds instead of ``d d_i``).
        Ids outside [0, V) fail in the lookup of the first or last cluster, as in
        ``nn.Embedding``."""
        starts, sizes, last = self.clusters.starts, self.clusters.sizes, len(self.clusters) - 1
        out = None
        for i, (start, size) in enumerate(zip(starts, sizes, strict=True)):
            local = ids - start
            if i > 0:
                local = local.clamp(min=0)  # ids of earlier clusters: masked out below
            if i < last:
                local = local.clamp(max=size - 1)  # ids of later clusters: masked out later
            x = F.linear(self.embeddings[i](local), self.projections[i])
            out = x if out is None else torch.where((ids >= start).unsqueeze(-1), x, out)
        return out.to(self.embeddings[0].weight.dtype) * self.scale


class AdaptiveSoftmax(nn.Module):
    """Adaptive softmax (Grave et al. 2017, §4) with projected clusters (Baevski & Auli 2018):
    the head's logits are the shortlist's and one per tail cluster (row ``i - 1`` of
    ``cluster`` is tail cluster i's), each tail a softmax of its own (see the module).

    Parameters: ``cluster`` (C, b_C; none without cutoffs), ``biases`` b_i and, untied,
    ``weights`` W_i (n_i, d_i) and ``projections`` P_i (d_model, d_i). With ``tie`` (an
    :class:`AdaptiveInput` of the same clusters), W_i and P_i are the input's E_i and P_i,
    read from it at every call and not registered here: the state dict holds each tensor once
    (safetensors refuses shared tensors), and ``.to()``, ``deepcopy`` and ``load_state_dict``
    of the model that owns both keep the tie. Init: as ``nn.Linear(d_i, n_i)`` (W_i, b_i),
    P_i as :class:`AdaptiveInput`'s, C as ``nn.Linear(d_model, k)``: the authors'.
    Both outputs are float32 (log-softmax of the logits cast to float32; float64 stays)."""

    def __init__(self, vocab_size: int, d_model: int, cutoffs: Sequence[int] = (),
                 div_val: int = 4, tie: AdaptiveInput | None = None) -> None:
        super().__init__()
        self.clusters = clusters = Clusters(vocab_size, d_model, cutoffs, div_val)
        if tie is not None and tie.clusters != clusters:
            raise ValueError("the tied input must have the softmax's clusters")
        k, sizes, dims = len(clusters) - 1, clusters.sizes, clusters.dims
        self.cluster = nn.Linear(d_model, k) if k else None
        self.biases = nn.ParameterList(
            nn.init.uniform_(nn.Parameter(torch.empty(n)), -d**-0.5, d**-0.5)
            for n, d in zip(sizes, dims, strict=True))
        object.__setattr__(self, "tied", tie)  # not a submodule: its tensors registered once
        if tie is None:
            self.weights = nn.ParameterList(
                nn.init.kaiming_uniform_(nn.Parameter(torch.empty(n, d)), a=math.sqrt(5))
                for n, d in zip(sizes, dims, strict=True))
            self.projections = nn.ParameterList(_projection(d_model, d) for d in dims)

    def weight(self, i: int) -> Tensor:
        """W_i (n_i, d_i): the tied input's E_i, or this module's own."""
        return self.weights[i] if self.tied is None else self.tied.embeddings[i].weight

    def projection(self, i: int) -> Tensor:
        """P_i (d_model, d_i): the tied input's, or this module's own."""
        return self.projections[i] if self.tied is None else self.tied.projections[i]

    def logits(self, i: int, h: Tensor) -> Tensor:
        """Cluster i's logits ``(h P_i) W_i^T + b_i``; for i = 0 followed by the k tail
        clusters' ``(h P_0) C^T + b_C`` (the head): (..., n_0 + k) or (..., n_i)."""
        x = F.linear(h, self.projection(i).t())
        logits = F.linear(x, self.weight(i), self.biases[i])
        if i == 0 and self.cluster is not None:
            logits = torch.cat([logits, self.cluster(x)], dim=-1)
        return logits

    def log_probs(self, h: Tensor) -> Tensor:
        """log p(t) (..., V) of every token: the full distribution, no host synchronisation."""
        head = F.log_softmax(at_least_float32(self.logits(0, h)), dim=-1)
        n_0 = self.clusters.sizes[0]
        parts = [head[..., :n_0]]
        for i in range(1, len(self.clusters)):
            tail = F.log_softmax(at_least_float32(self.logits(i, h)), dim=-1)
            parts.append(head[..., n_0 + i - 1, None] + tail)
        return torch.cat(parts, dim=-1)

    def target_log_probs(self, h: Tensor, targets: Tensor) -> Tensor:
        """log p(targets) (...) for ``h`` (..., d_model): the head at every position, tail
        cluster i only at the positions whose target is in it. Finding those positions reads
        their counts to the host: one synchronisation per call (none without cutoffs). Every
        cluster is computed, with no rows where no target is in it, so that every parameter
        gets a gradient (DistributedDataParallel expects one)."""
        if h.shape[:-1] != targets.shape:
            raise ValueError(f"targets {tuple(targets.shape)} do not match the states "
                             f"{tuple(h.shape)}")
        shape = targets.shape
        h, targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
        head = F.log_softmax(at_least_float32(self.logits(0, h)), dim=-1)
        cluster = self.clusters.of(targets)
        column = torch.where(cluster == 0, targets, self.clusters.sizes[0] + cluster - 1)
        out = head.gather(1, column[:, None])[:, 0]
        if len(self.clusters) > 1:
            rows = self.clusters.members(cluster)
            for i in range(1, len(self.clusters)):
                tail = F.log_softmax(at_least_float32(self.logits(i, h[rows[i]])), dim=-1)
                local = targets[rows[i]] - self.clusters.starts[i]
                out = out.index_add(0, rows[i], tail.gather(1, local[:, None])[:, 0])
        return out.view(shape)

    def flops(self) -> int:
        """Multiply-adds per position of :meth:`log_probs` (:meth:`Clusters.flops`)."""
        return self.clusters.flops()

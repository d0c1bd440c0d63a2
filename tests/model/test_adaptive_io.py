"""Adaptive input and softmax (adaspan.model.adaptive_io) against references written from the
equations (loops over tokens, explicit softmax); their ties; SpanLM with ``adaptive_io``:
state dict, targets path, decoders, FLOPs, parameter count, a few training steps."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny
from safetensors.torch import load_file, save_file
from syncs import SyncCounter, assert_static_steps

from adaspan import ModelConfig, SpanLM
from adaspan.attention.cache import StreamCache
from adaspan.config import ConfigError, TrainConfig
from adaspan.measure.generate import stream
from adaspan.model.adaptive_io import AdaptiveInput, AdaptiveSoftmax, Clusters
from adaspan.model.analysis import flops_per_char
from adaspan.model.decode import Decoder, decoder
from adaspan.model.lm import Softmax, parameter_count
from adaspan.training.optim import build_optimizer, build_scheduler
from adaspan.training.train import train_step

D = 16
LAYOUTS = [(40, ()), (40, (10,)), (40, (5, 17, 30)), (7, (1, 2, 6))]  # (V, cutoffs)


def _cluster_of(clusters: Clusters, t: int) -> int:
    return max(i for i, start in enumerate(clusters.starts) if t >= start)


def naive_input(module: AdaptiveInput, ids: list[int]) -> torch.Tensor:
    """sqrt(d) P_i E_i[t - c_i], token by token."""
    rows = []
    for t in ids:
        i = _cluster_of(module.clusters, t)
        e = module.embeddings[i].weight[t - module.clusters.starts[i]]
        rows.append(math.sqrt(module.clusters.d_model) * (module.projections[i] @ e))
    return torch.stack(rows)


def _log_softmax(z: torch.Tensor) -> torch.Tensor:
    """log(exp(z_j) / sum_l exp(z_l)), written out."""
    e = torch.exp(z - z.max())
    return torch.log(e / e.sum())


def naive_log_probs(module: AdaptiveSoftmax, h: torch.Tensor) -> torch.Tensor:
    """log p(t) of every token t for one state h (d,), from the equations: head logits
    (h P_0) W_0[j] + b_0[j] and (h P_0) C[i - 1] + b_C[i - 1]; tail i (h P_i) W_i[j] + b_i[j]."""
    clusters = module.clusters
    x0 = h @ module.projection(0)
    head = [x0 @ module.weight(0)[j] + module.biases[0][j] for j in range(clusters.sizes[0])]
    head += [x0 @ module.cluster.weight[i - 1] + module.cluster.bias[i - 1]
             for i in range(1, len(clusters))]
    head = _log_softmax(torch.stack(head))
    out = []
    for t in range(clusters.vocab_size):
        i = _cluster_of(clusters, t)
        if i == 0:
            out.append(head[t])
            continue
        x = h @ module.projection(i)
        tail = _log_softmax(torch.stack([x @ module.weight(i)[j] + module.biases[i][j]
                                         for j in range(clusters.sizes[i])]))
        out.append(head[clusters.sizes[0] + i - 1] + tail[t - clusters.starts[i]])
    return torch.stack(out)


def _modules(vocab: int, cutoffs: tuple, tied: bool, div_val: int = 2):
    torch.manual_seed(0)
    embed = AdaptiveInput(vocab, D, cutoffs, div_val).double()
    out = AdaptiveSoftmax(vocab, D, cutoffs, div_val, embed if tied else None).double()
    with torch.no_grad():  # biases away from their init, so that a wrong one shows
        for bias in out.biases:
            bias.normal_()
    return embed, out


@pytest.mark.parametrize(("vocab", "cutoffs"), LAYOUTS)
def test_input_equals_a_loop_over_tokens(vocab, cutoffs):
    embed, _ = _modules(vocab, cutoffs, tied=False)
    ids = torch.randint(0, vocab, (3, 11), generator=torch.Generator().manual_seed(1))
    ids[0, :vocab] = torch.arange(vocab)[:11]
    expected = naive_input(embed, ids.flatten().tolist()).view(3, 11, D)
    torch.testing.assert_close(embed(ids), expected, atol=1e-12, rtol=1e-12)
    assert [tuple(e.weight.shape) for e in embed.embeddings] == list(
        zip(embed.clusters.sizes, embed.clusters.dims, strict=True))
    with pytest.raises(IndexError):
        embed(torch.tensor([vocab]))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize(("vocab", "cutoffs"), LAYOUTS)
def test_log_probs_equal_the_equations_and_sum_to_one(vocab, cutoffs, tied):
    _, out = _modules(vocab, cutoffs, tied)
    h = torch.randn(2, 3, D, dtype=torch.float64)
    log_probs = out.log_probs(h)
    assert log_probs.shape == (2, 3, vocab)
    expected = torch.stack([naive_log_probs(out, row) for row in h.view(-1, D)]).view(2, 3, -1)
    torch.testing.assert_close(log_probs, expected, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(2, 3, dtype=torch.float64))


def _grads(module: torch.nn.Module, h: torch.Tensor, loss) -> dict[str, torch.Tensor]:
    module.zero_grad()
    h = h.detach().requires_grad_()
    loss(h).backward()
    return {"h": h.grad, **{name: p.grad for name, p in module.named_parameters()}}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize(("vocab", "cutoffs"), LAYOUTS)
def test_the_targets_path_equals_the_full_distribution_with_its_gradients(vocab, cutoffs, tied):
    embed, out = _modules(vocab, cutoffs, tied)
    owner = torch.nn.ModuleDict({"embed": embed, "out": out}) if tied else out
    h = torch.randn(4, 9, D, dtype=torch.float64)
    targets = torch.randint(0, vocab, (4, 9), generator=torch.Generator().manual_seed(2))
    targets[0, 0] = vocab - 1
    weights = torch.randn(4, 9, dtype=torch.float64)
    picked = out.target_log_probs(h, targets)
    assert picked.dtype == torch.float64 and picked.shape == (4, 9)
    torch.testing.assert_close(picked, out.log_probs(h).gather(-1, targets[..., None])[..., 0],
                               atol=1e-12, rtol=1e-12)
    fast = _grads(owner, h, lambda h: (weights * out.target_log_probs(h, targets)).sum())
    full = _grads(owner, h, lambda h: (weights * out.log_probs(h).gather(
        -1, targets[..., None])[..., 0]).sum())
    assert fast.keys() == full.keys() and all(g is not None for g in fast.values())
    torch.testing.assert_close(fast, full, atol=1e-12, rtol=1e-12)


def test_one_cluster_is_a_plain_projected_softmax():
    """No cutoffs, untied: log_softmax(h (W P^T)^T + b), outputs and every gradient."""
    _, out = _modules(30, (), tied=False)
    assert out.cluster is None
    h = torch.randn(5, 7, D, dtype=torch.float64)
    W, P, b = out.weights[0], out.projections[0], out.biases[0]

    def plain(h):
        return F.log_softmax(h @ (W @ P.t()).t() + b, dim=-1)

    torch.testing.assert_close(out.log_probs(h), plain(h), atol=1e-6, rtol=1e-6)
    cotangent = torch.randn(5, 7, 30, dtype=torch.float64)
    ours = _grads(out, h, lambda h: (cotangent * out.log_probs(h)).sum())
    theirs = _grads(out, h, lambda h: (cotangent * plain(h)).sum())
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)


def test_float32_outputs_under_bfloat16_autocast():
    embed = AdaptiveInput(50, D, (10, 30), 2)
    out = AdaptiveSoftmax(50, D, (10, 30), 2, embed)
    ids = torch.randint(0, 50, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x = embed(ids)
        full, picked = out.log_probs(x), out.target_log_probs(x, ids)
    assert x.dtype == full.dtype == picked.dtype == torch.float32
    torch.testing.assert_close(x, embed(ids), atol=0.1, rtol=0.02)
    torch.testing.assert_close(picked, full.gather(-1, ids[..., None])[..., 0])


def test_host_synchronisations_only_where_targets_pick_the_tail_rows():
    """The input and the full distribution never wait for the device; the targets path reads
    the clusters' counts once (none without tail clusters)."""
    for cutoffs, expected in (((10, 30), 1), ((), 0)):
        embed = AdaptiveInput(50, D, cutoffs, 2)
        out = AdaptiveSoftmax(50, D, cutoffs, 2, embed)
        ids = torch.randint(0, 50, (2, 8))
        with SyncCounter() as syncs:
            x = embed(ids)
            out.log_probs(x)
        assert syncs.count == 0, syncs.report()
        with SyncCounter() as syncs:
            out.target_log_probs(x, ids)
        assert syncs.count == expected, syncs.report()


def test_initialisation():
    """E_i ~ N(0, 1/d_i) (Baevski & Auli), the rest as nn.Linear's; so the tied output of a
    fresh model starts near a uniform guess (loss ~ ln V), where N(0, 1) starts far above."""
    torch.manual_seed(0)
    embed = AdaptiveInput(3000, 64, (1000,), 4)
    out = AdaptiveSoftmax(3000, 64, (1000,), 4)
    for i, d in enumerate((64, 16)):
        assert embed.embeddings[i].weight.std().item() == pytest.approx(d**-0.5, rel=0.05)
        for tensor in (embed.projections[i], out.projections[i], out.weights[i], out.biases[i]):
            assert tensor.abs().max() <= d**-0.5
    assert embed.scale == 8.0


# ----------------------------------------------------------------------------- SpanLM

NAMES_TIED = ["embed.embeddings.0.weight", "embed.embeddings.1.weight",
              "embed.embeddings.2.weight", "embed.projections.0", "embed.projections.1",
              "embed.projections.2", "out.cluster.weight", "out.cluster.bias", "out.biases.0",
              "out.biases.1", "out.biases.2"]


def adaptive(tie_io: bool = True, **changes) -> SpanLM:
    options = dict(adaptive_io=True, cutoffs="8,20", div_val=2, tie_io=tie_io)
    return tiny("adaptive", **{**options, **changes})


def flatter(model: SpanLM) -> SpanLM:
    """``model`` with its embeddings scaled down: tied N(0, 1) embeddings (the authors' init)
    give logits of many nats, peaked distributions."""
    with torch.no_grad():
        for embedding in model.embed.embeddings:
            embedding.weight.mul_(0.2)
    return model


def _io_names(model: SpanLM) -> list[str]:
    return [name for name in model.state_dict() if name.startswith(("embed.", "out."))]


def test_state_dict_names_and_shapes():
    model = adaptive()
    assert _io_names(model) == NAMES_TIED
    state = model.state_dict()
    shapes = {name: tuple(state[name].shape) for name in NAMES_TIED}
    assert shapes["embed.embeddings.1.weight"] == (12, 8)  # n_1 = 20 - 8, d_1 = 16 // 2
    assert shapes["embed.projections.2"] == (16, 4)
    assert shapes["out.cluster.weight"] == (2, 16) and shapes["out.biases.2"] == (12,)
    untied = adaptive(tie_io=False)
    assert _io_names(untied) == NAMES_TIED + [f"out.{kind}.{i}" for kind in
                                              ("weights", "projections") for i in range(3)]
    assert _io_names(tiny("adaptive")) == ["embed.weight", "out.weight", "out.bias"]
    assert isinstance(tiny("adaptive").out, Softmax)


def test_the_tie_holds_through_checkpoints_copies_and_conversions(tmp_path):
    model = adaptive()
    pointers = [t.data_ptr() for t in model.state_dict().values()]
    assert len(pointers) == len(set(pointers))  # each tensor once: safetensors accepts it
    save_file(model.state_dict(), tmp_path / "model.safetensors")
    restored = SpanLM(model.config)
    restored.load_state_dict(load_file(tmp_path / "model.safetensors"))
    for other in (restored, copy.deepcopy(model), model.to(torch.float64)):
        for i in range(3):
            assert other.out.weight(i) is other.embed.embeddings[i].weight
            assert other.out.projection(i) is other.embed.projections[i]
    tokens = torch.randint(0, 32, (2, 10))
    torch.testing.assert_close(restored(tokens)[0], model.float()(tokens)[0])
    assert sum(p.numel() for p in model.parameters()) == parameter_count(model.config)


def test_a_tied_matrix_gets_the_gradients_of_both_uses_and_one_step_moves_both():
    tied = adaptive().train()
    untied = adaptive(tie_io=False).train()
    state = tied.state_dict()
    state.update({f"out.{kind}.{i}": state[f"embed.{name}"] for i in range(3)
                  for kind, name in (("weights", f"embeddings.{i}.weight"),
                                     ("projections", f"projections.{i}"))})
    untied.load_state_dict(state)
    tokens, targets = torch.randint(0, 32, (2, 2, 12)).unbind()
    for model in (tied, untied):
        model(tokens, targets=targets)[0].sum().backward()
    for i in range(3):
        torch.testing.assert_close(tied.embed.embeddings[i].weight.grad,
                                   untied.embed.embeddings[i].weight.grad
                                   + untied.out.weights[i].grad)
        torch.testing.assert_close(tied.embed.projections[i].grad,
                                   untied.embed.projections[i].grad
                                   + untied.out.projections[i].grad)
    before = tied.out.weight(2).detach().clone()
    torch.optim.SGD(tied.parameters(), lr=0.1).step()
    assert not torch.equal(tied.out.weight(2), before)
    assert tied.out.weight(2) is tied.embed.embeddings[2].weight


@pytest.mark.parametrize("changes", [{}, {"tie_io": False}, {"cutoffs": ""}],
                         ids=["tied", "untied", "one-cluster"])
def test_forward_with_targets_gives_their_log_probabilities(changes):
    model = adaptive(**changes)
    tokens, targets = torch.randint(0, 32, (2, 3, 20)).unbind()
    with torch.no_grad():
        full, cache = model(tokens)
        picked, cache2 = model(tokens, targets=targets)
    assert full.shape == (3, 20, 32) and picked.shape == (3, 20) and picked.dtype == torch.float32
    torch.testing.assert_close(picked, full.gather(-1, targets[..., None])[..., 0])
    torch.testing.assert_close(cache2, cache)
    with pytest.raises(ValueError, match="targets"):
        model(tokens, targets=targets[:, :5])


def test_the_plain_output_s_targets_path_is_its_gather():
    model = tiny("adaptive")
    tokens, targets = torch.randint(0, 32, (2, 2, 9)).unbind()
    full, _ = model(tokens)
    torch.testing.assert_close(model(tokens, targets=targets)[0],
                               full.gather(-1, targets[..., None])[..., 0], atol=0, rtol=0)


def test_flops_count_the_full_adaptive_distribution():
    model = adaptive()  # d = 16, clusters [0, 8), [8, 20), [20, 32) of dims 16, 8, 4
    head, tails = 16 * 16 + 16 * (8 + 2), (16 * 8 + 8 * 12) + (16 * 4 + 4 * 12)
    plain = tiny("adaptive")
    assert model.out.flops() == head + tails and plain.out.flops() == 16 * 32
    assert flops_per_char(model, 32) - flops_per_char(plain, 32) == head + tails - 16 * 32


def test_parameter_count_on_the_meta_device():
    for tie_io in (True, False):
        config = adaptive(tie_io).config
        assert parameter_count(config) == SpanLM(config).num_parameters()
    tied, untied = (parameter_count(adaptive(t).config) for t in (True, False))
    assert untied - tied == (8 * 16 + 12 * 8 + 12 * 4) + 16 * (16 + 8 + 4)  # W_i, P_i


def test_compile_dense_leaves_the_adaptive_softmax_eager():
    """Its tail clusters take as many rows as targets fall in them: no static shapes."""
    assert "head" not in vars(adaptive().compile_dense())  # the method, not a compiled one
    assert "head" in vars(tiny("adaptive").compile_dense())


@pytest.mark.parametrize("options", [
    dict(cutoffs="8"), dict(adaptive_io=True, cutoffs="8,x"), dict(adaptive_io=True, cutoffs="40"),
    dict(adaptive_io=True, cutoffs="20,8"), dict(adaptive_io=True, cutoffs="0,8"),
    dict(adaptive_io=True, div_val=0), dict(adaptive_io=True, cutoffs="1,2,3", div_val=4),
    dict(adaptive_io="yes"), dict(tie_io=1)])
def test_invalid_adaptive_options_are_one_line_config_errors(options):
    base = dict(vocab_size=32, d_model=16, n_heads=4, n_layers=1, d_inner=32, max_span=64,
                ramp=8)
    with pytest.raises(ConfigError) as error:
        ModelConfig(**{**base, **options})
    assert "\n" not in str(error.value)


def test_cutoff_ids():
    config = ModelConfig(adaptive_io=True, vocab_size=300000, cutoffs="20000, 40000,200000")
    assert config.cutoff_ids == (20000, 40000, 200000)
    assert ModelConfig().cutoff_ids == () and ModelConfig().adaptive_io is False


# ---------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("static", [False, True], ids=["host-position", "static"])
@pytest.mark.parametrize("changes", [{}, {"tie_io": False}], ids=["tied", "untied"])
def test_decoders_give_the_log_probabilities_of_the_model_forward(changes, static):
    model = adaptive(**changes)
    assert Decoder.handles(model)
    tokens = torch.randint(0, 32, (1, 90), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, _ = model(tokens, model.empty_cache(1, keys_values=True))
        _, cache = model(tokens[:, :10], model.empty_cache(1, keys_values=True))
        step = decoder(model, cache, 10, static=static)
        decoded = torch.stack([step(int(t)).clone() for t in tokens[0, 10:]])
    torch.testing.assert_close(decoded, expected[0, 10:], atol=2e-5, rtol=0)


def test_the_static_step_keeps_its_buffers_and_shapes_and_never_synchronises():
    """As test_generate's for the byte model: what a CUDA graph's capture needs."""
    model = adaptive()
    assert_static_steps(model, torch.randint(0, 32, (80,),
                                             generator=torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("static", [False, True], ids=["host-position", "static"])
def test_decoders_under_bfloat16_autocast_are_close_to_the_model_forward(static):
    model = flatter(adaptive())
    tokens = torch.randint(0, 32, (1, 60), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        _, cache = model(tokens[:, :10], model.empty_cache(1, keys_values=True))
        step = decoder(model, cache, 10, static=static)
        decoded = torch.stack([step(int(t)).clone() for t in tokens[0, 10:]])
        expected, _ = model(tokens, model.empty_cache(1, keys_values=True))
    assert decoded.dtype == torch.float32
    assert (decoded - expected[0, 10:]).abs().max() < 0.1  # bf16 rounding: about 0.04


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_generation_follows_the_model_forward(temperature):
    """stream() (prompt by the forward, then the decoder) against every token through the
    model's forward over the whole text, drawn alike."""
    model = flatter(adaptive(vocab_size=64, cutoffs="10,30"))
    prompt = [3, 40, 12, 59, 0]
    generated = list(stream(model, prompt, 40, temperature=temperature,
                            generator=torch.Generator().manual_seed(7)))
    expected, tokens, draws = [], list(prompt), torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _ in range(40):
            log_probs = model(torch.tensor([tokens]))[0][0, -1]
            tokens.append(int(log_probs.argmax()) if temperature == 0 else
                          int(torch.multinomial(log_probs.softmax(-1), 1, generator=draws)))
            expected.append(tokens[-1])
    assert generated == expected
    if temperature:
        assert {_cluster_of(model.embed.clusters, t) for t in expected} == {0, 1, 2}


# ---------------------------------------------------------------------------- training


def test_a_few_training_steps_lower_the_loss():
    torch.manual_seed(0)
    model = SpanLM(ModelConfig(vocab_size=1000, d_model=32, n_heads=4, n_layers=2, d_inner=64,
                               max_span=64, ramp=8, span_bucket=8, dropout=0.0,
                               adaptive_io=True, cutoffs="100,400"))
    config = TrainConfig(batch_size=4, block_size=24, optimizer="adamw", lr=1e-2, warmup=0,
                         clip=0.0, device="cpu", dtype="float32")
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config)
    tokens = torch.randint(0, 1000, (4, 25), generator=torch.Generator().manual_seed(3))
    tokens[:, ::3] = tokens[:, ::3] % 100  # every cluster appears, the head the most
    x, y = tokens[:, :-1], tokens[:, 1:]
    losses = []
    for _ in range(12):
        loss, _ = train_step(model, optimizer, scheduler, x, y,
                             StreamCache(model.empty_cache(4)), config)
        losses.append(loss.item())
    # tied embeddings of N(0, 1/d_i) start below twice a uniform guess (2 ln V: where
    # training stops as diverged); N(0, 1) started above it at d_model = 192
    assert losses[0] < 2 * math.log(1000) and losses[-1] < 0.6 * losses[0], losses


@pytest.mark.parametrize("preset", ["words-small", "wt103-all-attention"])
def test_the_word_presets_start_below_where_training_stops_as_diverged(preset):
    """A fresh model's loss on Zipf-distributed words is under 2 log V, the bound at which
    train() stops a run as diverged (the WikiText-103 model with 2 of its 36 layers)."""
    from adaspan.resolve import resolve_config

    config, _ = resolve_config(preset, None, ["n_layers=2"])
    torch.manual_seed(0)
    model = SpanLM(config).eval()
    ranks = torch.arange(1, config.vocab_size + 1, dtype=torch.float64)
    tokens = torch.multinomial(1 / ranks, 2 * 65, replacement=True,
                               generator=torch.Generator().manual_seed(0)).view(2, 65)
    with torch.no_grad():
        log_probs, _ = model(tokens[:, :-1], targets=tokens[:, 1:])
    assert -log_probs.mean().item() < 2 * math.log(config.vocab_size)

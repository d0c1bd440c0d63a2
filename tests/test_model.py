"""SpanLM invariants: truncation, caching, span limits, causality, span penalty, config checks."""

from __future__ import annotations

import copy

import pytest
import torch
from reference import distances_that_move, run_blocks

from adaspan import ModelConfig, SpanLM
from adaspan.cache import KeyValueCache
from adaspan.config import ATTENTIONS

KINDS = ("fixed", "adaptive", "dynamic")


def tiny(kind: str = "adaptive", **kw) -> SpanLM:
    options = dict(vocab_size=32, d_model=16, n_heads=4, n_layers=2, d_inner=32, max_span=64,
                   ramp=8, dropout=0.0, attention=kind, span_bucket=8)
    options.update(kw)
    torch.manual_seed(0)
    model = SpanLM(ModelConfig(**options))
    if kind == "adaptive":
        spans = [[10.0, 20.0, 40.0, 64.0], [8.0, 9.0, 33.0, 17.5]]
        model.set_spans([s[: model.config.n_heads] for s in spans[: model.config.n_layers]])
    if kind == "dynamic":
        for layer in model.layers:
            with torch.no_grad():
                layer.attn.span.v.normal_(0, 0.3)
                layer.attn.span.b.uniform_(-3, 0)
    return model.eval()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("truncation", ["head", "layer"])
def test_truncated_equals_untruncated_over_blocks(kind, truncation):
    model = tiny(kind, truncation=truncation)
    full = copy.deepcopy(model)
    for layer in full.layers:
        layer.attn.truncation = "none"
    tokens = torch.randint(0, 32, (2, 100))
    with torch.no_grad():
        torch.testing.assert_close(run_blocks(model, tokens, 25), run_blocks(full, tokens, 25),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_block_by_block_equals_one_pass(kind):
    model = tiny(kind)
    tokens = torch.randint(0, 32, (3, 90))
    with torch.no_grad():
        torch.testing.assert_close(run_blocks(model, tokens, 30), run_blocks(model, tokens, 90),
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(run_blocks(model, tokens, 1)[:, :20],
                                   run_blocks(model, tokens, 90)[:, :20], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ATTENTIONS)
@pytest.mark.parametrize("truncation", ["head", "layer", "none"])
def test_key_value_cache_equals_hidden_state_cache(kind, truncation):
    model = tiny(kind, truncation=truncation, factorized_stride=16, factorized_c=4)
    tokens = torch.randint(0, 32, (2, 150))
    if kind not in KINDS:  # the baselines keep hidden states whatever keys_values says
        assert all(isinstance(c, torch.Tensor) for c in model.empty_cache(2, keys_values=True))
        return
    assert all(isinstance(c, KeyValueCache) for c in model.empty_cache(2, keys_values=True))
    with torch.no_grad():
        for block in (25, 7, 1):
            part = tokens[:, : 6 * block]
            torch.testing.assert_close(run_blocks(model, part, block, keys_values=True),
                                       run_blocks(model, part, block), atol=1e-5, rtol=1e-5)


def test_key_value_cache_is_trimmed_per_layer_and_refused_in_training():
    model = tiny("adaptive")
    with torch.no_grad():
        _, cache = model(torch.randint(0, 32, (2, 70)), model.empty_cache(2, keys_values=True))
    for layer, layer_cache in zip(model.layers, cache, strict=True):
        longest = max(layer.attn.key_windows(layer.attn.span(None)))
        assert layer_cache.keys.shape == layer_cache.values.shape == (2, 4, longest, 4)
    with pytest.raises(RuntimeError, match="no_grad"):
        model(torch.randint(0, 32, (2, 5)), cache)


def test_dynamic_cache_keeps_history_for_longer_later_spans():
    """A dynamic span can grow from one block to the next: the cache must still hold it."""
    model = tiny("dynamic", n_layers=1, max_span=48)
    span = model.layers[0].attn.span
    with torch.no_grad():  # z_t follows the token: token 0 -> span ~R, token 1 -> span ~S
        span.v.zero_()
        span.b.fill_(0.0)
        span.v[:, :] = model.embed.weight[1] - model.embed.weight[0]
    tokens = torch.cat([torch.zeros(1, 40, dtype=torch.long), torch.ones(1, 8, dtype=torch.long)],
                       dim=1)
    with torch.no_grad():
        short = span(model.embed(tokens[:, :40]))
        assert short.max() < 8 and span(model.embed(tokens[:, 40:])).min() > 40
        for keys_values in (False, True):
            torch.testing.assert_close(run_blocks(model, tokens, 40, keys_values),
                                       run_blocks(model, tokens, 48), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ATTENTIONS)
def test_causal(kind):
    """One layer: a change at position 25 never reaches earlier outputs, and reaches the next
    one only through attention (its own output also sees it through the residual)."""
    model = tiny(kind, n_layers=1, factorized_stride=16, factorized_c=4)
    if kind == "adaptive":
        model.set_spans([[10.0, 20.0, 40.0, 64.0]])
    tokens = torch.randint(0, 32, (1, 40))
    changed = tokens.clone()
    changed[0, 25] = (changed[0, 25] + 1) % 32
    with torch.no_grad():
        a, b = model(tokens)[0], model(changed)[0]
    assert torch.equal(a[:, :25], b[:, :25])
    assert not torch.allclose(a[:, 26], b[:, 26])


@pytest.mark.parametrize("z", [0.0, 5.0, 21.5])
def test_one_layer_sees_exactly_its_span(z):
    """A token z + R or more back does not change the output; one inside the span does."""
    model = tiny("adaptive", n_layers=1, n_heads=2, max_span=64)
    ramp = model.config.ramp
    model.set_spans([[z + ramp, z + ramp]])
    limit = int(torch.tensor(z + ramp).ceil())  # first distance with m_z = 0
    t = 60
    tokens = torch.randint(0, 32, (1, t + 1))
    distances = range(1, t + 1)
    moved = distances_that_move(model, tokens, t, distances)
    assert moved == [d < limit for d in distances]


def test_cache_reaches_into_previous_blocks():
    model = tiny("fixed", n_layers=1)
    tokens = torch.randint(0, 32, (1, 40))
    changed = tokens.clone()
    changed[0, 15] = (changed[0, 15] + 1) % 32
    with torch.no_grad():
        a, b = run_blocks(model, tokens, 20), run_blocks(model, changed, 20)
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_span_penalty_is_lambda_over_heads_times_sum_z():
    model = tiny("adaptive", span_loss_coef=1e-3)
    spans = [[10.0, 20.0, 40.0, 64.0], [8.0, 9.0, 33.0, 17.5]]
    model.set_spans(spans)
    z = [max(0.0, s - model.config.ramp) for layer in spans for s in layer]
    expected = 1e-3 / model.config.n_heads * sum(z)
    assert model.span_loss().item() == pytest.approx(expected, rel=1e-6)
    assert model.spans() == [[max(s, 8.0) for s in layer] for layer in spans]


def test_dynamic_span_penalty_averages_tokens():
    model = tiny("dynamic", span_loss_coef=1.0)
    tokens = torch.randint(0, 32, (2, 10))
    model(tokens)
    z_means = [layer.attn.span(layer_input).mean(dim=(0, 2)).sum()
               for layer, layer_input in zip(model.layers, layer_inputs(model, tokens),
                                             strict=True)]
    expected = sum(z_means) / model.config.n_heads
    assert model.span_loss().item() == pytest.approx(expected.item(), rel=1e-5)


def layer_inputs(model: SpanLM, tokens: torch.Tensor) -> list[torch.Tensor]:
    inputs, h = [], model.embed(tokens)
    for layer in model.layers:
        inputs.append(h)
        h, _ = layer(h, torch.zeros(tokens.shape[0], 0, model.config.d_model), model.pos)
    return inputs


def test_fixed_span_has_no_penalty_and_full_spans():
    model = tiny("fixed")
    assert model.span_loss().item() == 0.0
    assert model.spans() == [[64.0] * 4] * 2
    with pytest.raises(ValueError, match="no learnable span"):
        model.set_spans([10.0] * 4)


def test_clamp_spans_keeps_z_frac_in_unit_interval():
    model = tiny("adaptive")
    with torch.no_grad():
        model.layers[0].attn.span.z_frac.copy_(torch.tensor([-0.5, 0.2, 1.7, 1.0]))
    model.clamp_spans()
    assert model.layers[0].attn.span.z_frac.tolist() == pytest.approx([0.0, 0.2, 1.0, 1.0])


def test_initialisation_follows_the_paper():
    model = SpanLM(ModelConfig(d_model=64, n_heads=4, n_layers=1, d_inner=128, max_span=2048))
    attn = model.layers[0].attn
    bound = 64**-0.5
    for proj in (attn.q, attn.k, attn.v, attn.o):
        assert proj.weight.abs().max() <= bound and proj.bias is None
    assert attn.span.z_frac.tolist() == [0.0] * 4
    assert model.embed.weight.std().item() == pytest.approx(1.0, abs=0.05)
    assert model.pos.std().item() == pytest.approx(1.0, abs=0.05)
    assert model.pos.shape == (2048, 16)  # one set of position embeddings for all heads


@pytest.mark.parametrize("kind", (*KINDS, "vanilla"))
def test_one_position_table_per_model(kind):
    """The paper's single set of p_d: one (S, d_head) parameter, read by every layer."""
    model = tiny(kind, n_layers=2)
    tables = [name for name, _ in model.named_parameters() if name.endswith("pos")]
    assert tables == ["pos"] and model.pos.shape == (64, 4)
    tokens = torch.randint(0, 32, (1, 40))
    model(tokens)[0][0, -1].sum().backward()
    assert model.pos.grad.abs().sum() > 0
    assert all(layer.attn.pos is None for layer in model.layers)
    per_layer = tiny(kind, n_layers=2, position_table="layer")
    assert [n for n, _ in per_layer.named_parameters() if n.endswith("pos")] == [
        f"layers.{i}.attn.pos" for i in range(2)]


def test_every_layer_reads_the_shared_table():
    model = tiny("adaptive", n_layers=2)
    h = torch.randn(1, 20, 16)
    for layer in model.layers:
        base = layer(h, layer.attn.empty_cache(1), model.pos)[0]
        moved = layer(h, layer.attn.empty_cache(1), model.pos + torch.randn_like(model.pos))[0]
        assert not torch.allclose(base, moved)
        with pytest.raises(ValueError, match="position table"):
            layer(h, layer.attn.empty_cache(1), None)


def test_follows_module_dtype():
    model = tiny("dynamic").double()
    out, cache = model(torch.randint(0, 32, (1, 5)))
    assert out.dtype == torch.float64 and cache[0].dtype == torch.float64
    assert torch.allclose(out.exp().sum(-1), torch.ones(1, 5, dtype=torch.float64))


@pytest.mark.parametrize(
    ("field", "value"),
    [("d_model", 30), ("n_heads", 0), ("ramp", 1), ("dropout", 1.0), ("attention", "sparse"),
     ("max_span", -5), ("span_init", 2.0), ("truncation", "some"), ("vocab_size", 2.5)],
)
def test_invalid_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}"):
        ModelConfig(**{field: value})


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown model option"):
        ModelConfig.from_dict({"d_model": 64, "heads": 4})


def test_bad_inputs_give_clear_errors():
    model = tiny()
    with pytest.raises(ValueError, match="shape"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="layers"):
        model(torch.zeros(1, 5, dtype=torch.long), cache=[])
    with pytest.raises(ValueError, match="spans"):
        model.set_spans([[1000.0] * 4] * 2)

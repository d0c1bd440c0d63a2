"""Span masks (paper §2.2): the soft mask, and the fixed, adaptive and dynamic spans: what a
head sees, the spans' penalty, their limits and their gradients, and what each span type
declares (learned, varying per token)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import TRAIN_MODEL, run_quietly, span_attention, tiny, tiny_config, tiny_train_config
from reference import distances_that_move

from adaspan import ModelConfig, SpanLM, soft_mask
from adaspan.attention.registry import ATTENTIONS
from adaspan.attention.span import AdaptiveSpan, DynamicSpan, FixedSpan
from adaspan.model.lm import parameter_count
from adaspan.run.checkpoint import load_model


def test_soft_mask_matches_the_formula():
    d = torch.arange(0, 20, dtype=torch.float32)
    m = soft_mask(d, torch.tensor(5.0), 4)
    expected = [1.0] * 6 + [0.75, 0.5, 0.25] + [0.0] * 11  # 1 up to z, ramp of width R, then 0
    assert m.tolist() == expected


def test_soft_mask_gradient_flows_to_z_on_the_ramp_only():
    z = torch.tensor(5.0, requires_grad=True)
    soft_mask(torch.tensor([3.0, 7.0, 12.0]), z, 4).sum().backward()
    assert z.grad.item() == pytest.approx(0.25)  # only the key at distance 7 is on the ramp


def test_span_gradient_at_initialisation_is_finite_and_nonzero():
    attn = span_attention("adaptive")
    attn.span.set_spans(torch.full((4,), 8.0))  # z = 0, the paper's initialisation
    attn(torch.randn(2, 12, 16), torch.randn(2, 4, 16))[0].square().sum().backward()
    grad = attn.span.z_frac.grad
    assert torch.isfinite(grad).all() and (grad != 0).all()


def test_dynamic_span_initialised_short():
    cfg = ModelConfig(d_model=16, n_heads=2, n_layers=1, max_span=1024, attention="dynamic")
    span = ATTENTIONS["dynamic"](cfg).span
    z = span(torch.randn(1, 5, 16))
    assert torch.allclose(z, torch.full_like(z, 1024 * torch.sigmoid(torch.tensor(-4.0))))


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


LEARNED_SPANS = [lambda: AdaptiveSpan(4, 64, 8), lambda: DynamicSpan(4, 64, 8, d_model=16)]


@pytest.mark.parametrize("make", LEARNED_SPANS)
def test_set_spans_is_the_inverse_of_spans(make):
    span = make()
    spans = torch.tensor([8.0, 9.5, 33.25, 64.0])  # from z = 0 (span R) to z + R = S
    span.set_spans(spans)
    torch.testing.assert_close(span.spans(), spans, atol=1e-3, rtol=0)
    spans[0] = 8.5  # z = 0.5: the mask reaches distance 8
    span.set_spans(spans)
    assert span.windows(span(torch.randn(2, 3, 16))) == [9, 10, 34, 64]  # min(S, ceil(z + R))


@pytest.mark.parametrize("make", LEARNED_SPANS)
def test_set_spans_refuses_spans_outside_the_limits(make):
    span = make()
    with pytest.raises(ValueError, match=r"spans must lie in \[1, max_span=64\]"):
        span.set_spans(torch.tensor([8.0, 9.0, 10.0, 65.0]))
    with pytest.raises(ValueError, match="spans must lie"):
        span.set_spans(torch.tensor([0.5, 9.0, 10.0, 11.0]))
    with pytest.raises(ValueError, match="expected 4 spans"):
        span.set_spans(torch.tensor([8.0, 9.0]))


def test_fixed_span_sees_everything_up_to_the_limit():
    span = FixedSpan(3, 40, 8)
    assert span(torch.randn(1, 5, 16)) is None  # no mask
    assert span.windows(None) == [40] * 3 and span.spans().tolist() == [40.0] * 3
    assert span.z_penalty() is None


@pytest.mark.parametrize("name", list(ATTENTIONS))
def test_span_type_says_whether_spans_are_learned(name):
    model = tiny(name)
    assert {type(layer.attn.span) for layer in model.layers} == {model.span_type}
    assert model.span_type.learned == model.span_loss().requires_grad  # the penalty trains z


@pytest.mark.parametrize("name", list(ATTENTIONS))
def test_span_type_says_whether_spans_vary_per_token(name):
    model = tiny(name)  # dynamic spans: random v, so z_t differs between tokens
    z = model.layers[0].attn.span(model.embed(torch.randint(0, 32, (2, 12))))
    varies = z is not None and z.shape[-1] > 1 and bool((z != z[..., :1]).any())
    assert model.span_type.input_dependent == varies


def test_last_spans_are_those_of_every_token_of_the_last_pass():
    span = DynamicSpan(4, 64, 8, d_model=16)
    with pytest.raises(RuntimeError, match="no forward pass"):
        span.last_spans()
    with torch.no_grad():
        span.v.normal_(0, 1.0)
    x = torch.randn(2, 5, 16)
    span(x)
    want = (64 * torch.sigmoid(x @ span.v.t() + span.b) + 8).clamp(max=64).transpose(1, 2)
    torch.testing.assert_close(span.last_spans(), want.detach())  # (B, H, M): min(S, z_t + R)
    span.set_spans(torch.full((4,), 20.0))
    with pytest.raises(RuntimeError, match="no forward pass"):
        span.last_spans()


# --- one span per layer (span_per="layer") -------------------------------------------------------

PER_LAYER_SPANS = [lambda: AdaptiveSpan(4, 64, 8, per_layer=True),
                   lambda: DynamicSpan(4, 64, 8, d_model=16, per_layer=True)]


def per_head_copy(model: SpanLM) -> SpanLM:
    """The same model with one span per head, every head given its layer's z (or v, b)."""
    per_head = SpanLM(replace(model.config, span_per="head")).to(model.embed.weight)
    state = {name: p.expand(per_head.state_dict()[name].shape) if ".span." in name else p
             for name, p in model.state_dict().items()}
    per_head.load_state_dict(state)
    return per_head.train(model.training)


@pytest.mark.parametrize("attention", ["adaptive", "dynamic"])
def test_one_span_per_layer_equals_equal_spans_per_head(attention):
    """Forward, loss with the penalty, and gradients: the shared z's gradient is the sum of the
    heads' gradients, every other gradient is the same."""
    shared = tiny(attention, span_per="layer", span_loss_coef=0.1).double()
    per_head = per_head_copy(shared)
    tokens = torch.randint(0, 32, (2, 30))
    losses = []
    for model in (shared, per_head):
        log_probs, cache = model(tokens[:, :15])
        log_probs, _ = model(tokens[:, 15:], cache)
        losses.append(-log_probs[:, :-1].gather(-1, tokens[:, 16:, None]).mean()
                      + model.span_loss())
        losses[-1].backward()
    torch.testing.assert_close(losses[0], losses[1], atol=1e-12, rtol=0)
    assert shared.spans() == per_head.spans()
    heads = dict(per_head.named_parameters())
    for name, p in shared.named_parameters():
        want = heads[name].grad.sum(0, keepdim=True) if ".span." in name else heads[name].grad
        torch.testing.assert_close(p.grad, want, atol=1e-12, rtol=1e-9, msg=name)
        assert p.grad.abs().sum() > 0, name  # the span too: the test would see a wrong sum


@pytest.mark.parametrize(("attention", "per_head"), [("adaptive", 1), ("dynamic", 16 + 1)])
def test_one_span_per_layer_has_one_span_parameter_set_per_layer(attention, per_head):
    """z' (adaptive) or v, b (dynamic): H sets per layer become one."""
    config = tiny_config(attention)
    saved = parameter_count(config) - parameter_count(replace(config, span_per="layer"))
    assert saved == config.n_layers * (config.n_heads - 1) * per_head
    model = tiny(attention, span_per="layer")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if ".span." in n}
    assert set(shapes.values()) == ({(1,)} if attention == "adaptive" else {(1,), (1, 16)})


def test_a_shared_span_is_penalised_once_per_head():
    """lambda/M sum z with a layer's z counted for each of its M heads: as M heads of span z."""
    model = tiny("adaptive", span_per="layer", span_loss_coef=1e-3)
    model.set_spans([[20.0] * 4, [45.5] * 4])
    z = [20.0 - 8, 45.5 - 8]  # z = span - R
    assert model.span_loss().item() == pytest.approx(1e-3 / 4 * 4 * sum(z), rel=1e-6)
    assert model.spans() == [[20.0] * 4, [45.5] * 4]


@pytest.mark.parametrize("make", PER_LAYER_SPANS)
def test_one_span_per_layer_is_set_and_read_for_every_head(make):
    span = make()
    span.set_spans(torch.full((4,), 30.5))
    assert span.spans().tolist() == pytest.approx([30.5] * 4, abs=1e-3)
    z = span(torch.randn(2, 3, 16))
    assert z.shape[1] == 4 and span.windows(z) == [31] * 4
    assert span.z_penalty().item() == pytest.approx(4 * 22.5, rel=1e-4)  # before a forward pass
    with pytest.raises(ValueError, match=r"share one span \(span_per='layer'\), got 8, 9, 8, 8"):
        span.set_spans(torch.tensor([8.0, 9.0, 8.0, 8.0]))


def test_one_span_per_layer_resumes_exactly(tmp_path, corpus_file):
    """Training saves and resumes the shared spans (z' of shape (1,)) bit for bit."""
    model = replace(TRAIN_MODEL, span_per="layer")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_quietly(straight, tiny_train_config(corpus_file, steps=6), model)
    run_quietly(resumed, tiny_train_config(corpus_file, steps=3), model)
    run_quietly(resumed, tiny_train_config(corpus_file, steps=6), model, resume=True)
    a, b = load_model(straight).state_dict(), load_model(resumed).state_dict()
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert a["layers.0.attn.span.z_frac"].shape == (1,)
    assert a["layers.0.attn.span.z_frac"].item() != TRAIN_MODEL.span_init  # it trained

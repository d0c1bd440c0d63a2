"""SpanLM invariants beyond the contract of every variant (test_contract.py): truncation, the
dynamic span's cache, the shared position table, initialisation, dtype, input errors."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import span_variants, tiny
from reference import run_blocks

from adaspan import ModelConfig, SpanLM
from adaspan.attention.registry import ATTENTIONS
from adaspan.model.analysis import effective_spans

SPAN_VARIANTS = span_variants()
# variants reading the model's table of p_d (position_table="model")
SHARED_POSITIONS = [name for name in ATTENTIONS if tiny(name).layers[0].attn.shared_positions]


@pytest.mark.parametrize("kind", SPAN_VARIANTS)
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


@pytest.mark.parametrize("kind", SHARED_POSITIONS)
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


def test_bad_inputs_give_clear_errors():
    model = tiny()
    with pytest.raises(ValueError, match="shape"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="layers"):
        model(torch.zeros(1, 5, dtype=torch.long), cache=[])
    with pytest.raises(ValueError, match="spans"):
        model.set_spans([[1000.0] * 4] * 2)


def test_compiled_dense_parts_equal_eager():
    """compile_dense: the same log-probabilities and gradients, the same state dict."""
    model = tiny("adaptive").train()
    compiled = copy.deepcopy(model).compile_dense()
    assert compiled.state_dict().keys() == model.state_dict().keys()
    tokens = torch.randint(0, 32, (2, 16))
    outputs = []
    for m in (model, compiled):
        log_probs, _ = m(tokens)
        log_probs.sum().backward()
        outputs.append((log_probs, m.layers[0].ff.fc1.weight.grad))
    (eager, eager_grad), (fast, fast_grad) = outputs
    torch.testing.assert_close(fast, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast_grad, eager_grad, atol=1e-5, rtol=1e-5)



def _compiled_and_eager(kind: str, backward: bool = False, **compile_options) -> list[tuple]:
    """Log-probabilities (and, with ``backward``, every parameter's gradient) of a one-layer
    :func:`tiny` model under ``torch.compile(model, **compile_options)`` and eagerly."""
    torch._dynamo.reset()  # a fresh compilation for each model, far from the recompile limit
    model = tiny(kind, n_layers=1)
    tokens = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for run in (torch.compile(model, **compile_options), model):
        model.zero_grad()
        log_probs, _ = run(tokens)
        grads = {}
        if backward:
            log_probs[..., 0].sum().backward()
            grads = {name: p.grad for name, p in model.named_parameters()}
        results.append((log_probs.detach(), grads))
    return results


@pytest.mark.parametrize("kind", list(ATTENTIONS))
def test_torch_compile_of_the_model_equals_eager(kind):
    """The band kernels run eagerly inside the compiled model (graph breaks). The aot_eager
    backend gets the graphs of the default one without its slow C++ code generation (traced,
    the band kernels gave other outputs there)."""
    compiled, eager = _compiled_and_eager(kind, backend="aot_eager")
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)


def test_torch_compile_with_the_default_backend_gives_the_eager_gradients():
    (compiled, compiled_grads), (eager, eager_grads) = _compiled_and_eager("adaptive", True)
    assert eager_grads["layers.0.attn.span.z_frac"].abs().sum() > 0  # the spans learn
    torch.testing.assert_close((compiled, compiled_grads), (eager, eager_grads), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize(
    ("kind", "block_size", "spans"),
    [("adaptive", 16, [[10.0, 20.0, 40.0, 64.0], [8.0, 9.0, 33.0, 17.5]]),  # their spans
     ("xl", 16, [[64.0] * 4] * 2),
     ("vanilla", 16, [[15.0] * 4] * 2),  # back to the first token of its block
     ("vanilla", 512, [[64.0] * 4] * 2),
     ("factorized", 16, [[15.0, 64.0, 15.0, 64.0]] * 2)],  # A(1) heads: their stride - 1
)
def test_effective_spans_are_as_far_as_each_head_reaches(kind, block_size, spans):
    assert effective_spans(tiny(kind), block_size) == spans

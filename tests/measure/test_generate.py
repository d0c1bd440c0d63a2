"""Generation's per-token step (adaspan.model.decode): the batch-1 decoders of span attention (the
host-counted one and the static one) give the model's own log-probabilities, the same bytes as
the model's forward, one host-device synchronisation per token; the static step keeps its
buffers and shapes and synchronises nothing (capturable in a CUDA graph); the other variants
decode through the model's forward."""

from __future__ import annotations

import pytest
import torch
from helpers import baseline_variants, span_variants, tiny
from syncs import SyncCounter, assert_static_steps

from adaspan.measure.generate import generate, stream
from adaspan.model.decode import Decoder, _Product, decoder


def _decoded(model, tokens: torch.Tensor, prompt: int, fast: bool = True,
             static: bool = False) -> torch.Tensor:
    """Log-probabilities (T - prompt, V) after each token from ``prompt`` on: the prompt read
    by the model's forward, then one :func:`decoder` step per token."""
    with torch.no_grad():
        _, cache = model(tokens[:, :prompt], model.empty_cache(1, keys_values=True))
        step = decoder(model, cache, prompt, fast=fast, static=static)
        return torch.stack([step(int(token)).clone() for token in tokens[0, prompt:]])


def _tokens(model, length: int) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (1, length),
                         generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("static", [False, True], ids=["host-position", "static"])
@pytest.mark.parametrize("prompt", [3, 70])  # before and after the ring (S = 64) wraps
@pytest.mark.parametrize("changes", [{}, {"position_table": "layer"}, {"truncation": "none"},
                                     {"span_per": "layer"}],
                         ids=["", "layer-positions", "no-truncation", "one-span-per-layer"])
@pytest.mark.parametrize("name", span_variants())
def test_decoder_gives_the_log_probabilities_of_one_forward_pass(name, changes, prompt, static):
    model = tiny(name, **changes)
    tokens = _tokens(model, prompt + 150)
    assert Decoder.handles(model)
    with torch.no_grad():
        expected, _ = model(tokens, model.empty_cache(1, keys_values=True))
    torch.testing.assert_close(_decoded(model, tokens, prompt, static=static),
                               expected[0, prompt:], atol=2e-5, rtol=0)


@pytest.mark.parametrize(("threads", "blocks"), [(1, 1), (2, 2), (3, 3), (5, 4), (16, 6)])
@pytest.mark.parametrize("add", [False, True], ids=["", "plus-a"])
def test_a_product_split_in_column_blocks_is_the_row_times_the_weight(threads, blocks, add):
    """``_Product``: a + x W^T written into the buffer, whether the weight is kept whole or in
    column blocks, up to one per thread, dividing its 384 columns into blocks of 64 or more
    (5 threads: 4 blocks of 96; 16: 6 of 64)."""
    generator = torch.Generator().manual_seed(0)
    weight, x, a = (torch.randn(*shape, generator=generator)
                    for shape in ((384, 7), (1, 7), (1, 384)))
    product = _Product(weight, torch.float32, threads)
    out = torch.full((1, 384), float("nan"))
    assert product(x, out, a if add else None) is out
    assert product.blocks == blocks
    expected = (a if add else 0) + x.double() @ weight.double().t()
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", span_variants())
def test_the_decoder_at_two_threads_splits_its_products_and_gives_the_same(name):
    """On the CPU the fp32 decoder keeps its weights in one column block per thread (the suite
    runs at one thread): with two, the same log-probabilities as the forward (a feed-forward
    of 128, two blocks of 64)."""
    model = tiny(name, d_inner=128)
    tokens = _tokens(model, 100)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.no_grad():
            expected, cache = model(tokens[:, :1], model.empty_cache(1, keys_values=True))
            blocks = Decoder(model, cache, 1).layers[0].fc1_product.blocks
            expected, _ = model(tokens, model.empty_cache(1, keys_values=True))
        got = _decoded(model, tokens, 30)
    finally:
        torch.set_num_threads(threads)
    assert blocks == 2
    torch.testing.assert_close(got, expected[0, 30:], atol=2e-5, rtol=0)


@pytest.mark.parametrize("name", span_variants())
def test_the_static_step_keeps_its_buffers_and_shapes_and_never_synchronises(name):
    """What a CUDA graph's capture needs: each step reads the token from the same device
    tensor and writes the same output buffer, every operator sees the same shapes and
    arguments (no position baked in), and nothing is read from or built on the host."""
    model = tiny(name, vocab_size=256)
    assert_static_steps(model, _tokens(model, 80)[0])  # past the ring's wrap (W <= S = 64)


@pytest.mark.parametrize("name", baseline_variants())
def test_other_variants_decode_through_the_model_forward(name):
    model = tiny(name)
    tokens = _tokens(model, 40)
    assert not Decoder.handles(model)
    rows = []
    with torch.no_grad():  # the prompt, then blocks of one token
        _, cache = model(tokens[:, :5], model.empty_cache(1, keys_values=True))
        for i in range(5, 40):
            log_probs, cache = model(tokens[:, i : i + 1], cache)
            rows.append(log_probs[0, -1])
    torch.testing.assert_close(_decoded(model, tokens, 5), torch.stack(rows), atol=0, rtol=0)


def _reference_generate(model, prompt: bytes, length: int, temperature: float,
                        top_k: int | None, generator: torch.Generator) -> bytes:
    """Generation as it was before the decoder: every token through ``model(token, cache)``,
    sampled on the host with ``generator``."""
    out = []
    with torch.no_grad():
        log_probs, cache = model(torch.tensor([list(prompt)]),
                                 model.empty_cache(1, keys_values=True))
        for _ in range(length):
            logits = log_probs[0, -1]
            if temperature == 0:
                token = int(logits.argmax())
            else:
                logits = logits / temperature
                if top_k is not None:
                    logits = logits.masked_fill(logits < logits.topk(top_k).values[-1],
                                              float("-inf"))
                token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
            out.append(token)
            log_probs, cache = model(torch.tensor([[token]]), cache)
    return bytes(out)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0),
                                      dict(temperature=0.8, top_k=5)],
                         ids=["greedy", "sampled", "top-k"])
@pytest.mark.parametrize("name", [*span_variants(), "xl"])
def test_generate_gives_the_bytes_of_the_model_forward(name, sampling):
    model = tiny(name, vocab_size=256)
    sampling = {"top_k": None, **sampling}
    expected = _reference_generate(model, b"In the", 120, **sampling,
                                   generator=torch.Generator().manual_seed(7))
    assert generate(model, b"In the", 120, **sampling,
                    generator=torch.Generator().manual_seed(7)) == expected


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("name", span_variants())
def test_one_synchronisation_per_generated_token(name, temperature):
    model = tiny(name, vocab_size=256)
    tokens = stream(model, b"In the beginning", 50, temperature=temperature, top_k=10,
                    generator=torch.Generator().manual_seed(0))
    next(tokens)  # the prompt is read, the decoder built, the first token sampled
    with SyncCounter() as syncs:
        rest = list(tokens)
    assert len(rest) == 49
    assert syncs.count <= len(rest), syncs.report()


@pytest.mark.parametrize("static", [False, True], ids=["host-position", "static"])
@pytest.mark.parametrize("name", span_variants())
def test_decoder_under_bfloat16_autocast_is_close_to_the_model_forward(name, static):
    model = tiny(name, vocab_size=256)
    tokens = _tokens(model, 100)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        decoded = _decoded(model, tokens, 10, static=static)
        reference = _decoded(model, tokens, 10, fast=False)
        text = generate(model, b"ab", 20, temperature=0.8,
                        generator=torch.Generator().manual_seed(0))
    assert decoded.dtype == torch.float32 and len(text) == 20
    assert (decoded - reference.float()).abs().max() < 0.1  # bf16 rounding: about 0.04


@pytest.mark.parametrize("changes", [dict(position_table="rotary"), dict(kv_heads=2)])
def test_rotary_and_grouped_query_models_decode_through_the_model_forward(changes):
    model = tiny("adaptive", **changes)
    assert not Decoder.handles(model)
    with torch.no_grad():
        _, cache = model(_tokens(model, 5), model.empty_cache(1, keys_values=True))
    with pytest.raises(ValueError, match="decodes through its own forward"):
        Decoder(model, cache, 5)

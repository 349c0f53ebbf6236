"""What a decode program does per call and per step: scanned parameters are unstacked
inside the compiled program, and the KV cache is kept in the layout its attention
implementation reads, so a step neither transposes nor concatenates it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.decode import cache as cache_lib
from jaxformer.nn import stacking

from conftest import numpy_params, random_tokens


def test_scanned_parameters_are_unstacked_once_per_compile_not_per_call(monkeypatch):
    config = jf.tiny(scan_layers=True)
    model = jf.Transformer(config)
    src = random_tokens(0, (2, 5), config.src_vocab_size)
    params = numpy_params(model, src, src[:, :3])
    calls = []
    real = stacking.unstack_layers

    def counting(tree):
        calls.append(isinstance(jax.tree_util.tree_leaves(tree)[0], jax.core.Tracer))
        return real(tree)

    monkeypatch.setattr(stacking, "unstack_layers", counting)
    first = jf.greedy_decode(model, params, src, max_new_tokens=4)
    again = jf.greedy_decode(model, params, src, max_new_tokens=4)
    assert calls == [True]  # once, while tracing: inside the program
    np.testing.assert_array_equal(first.tokens, again.tokens)
    unrolled = jf.Transformer(config.replace(scan_layers=False))
    want = jf.greedy_decode(unrolled, real(params), src, max_new_tokens=4)
    np.testing.assert_array_equal(first.tokens, want.tokens)


@pytest.mark.parametrize("impl, layout", [("einsum", "BGTK"), ("jax", "BTGK")])
def test_the_cache_layout_follows_the_attention_implementation(impl, layout):
    config = jf.llama(num_kv_heads=2, attention_impl=impl, d_model=32, num_heads=4)
    cache = cache_lib.init_cache(config, batch=3, max_len=7)
    sizes = dict(B=3, G=2, T=7, K=config.head_dim)
    assert cache.self_kv[0].key.shape == tuple(sizes[d] for d in layout)


def _cache_moves(config, params, tokens, max_len):
    """Transposes and concatenates of a whole cached key/value array in one cached step."""
    model = jf.DecoderOnlyLM(config)
    cache = cache_lib.init_cache(config, batch=tokens.shape[0], max_len=max_len)
    cache_shape = cache.self_kv[0].key.shape
    step = jax.make_jaxpr(lambda p, c, t: cache_lib.cached_forward(model, p, c, t))(
        params, cache, tokens[:, :1])
    return [e.primitive.name for e in step.jaxpr.eqns
            if e.primitive.name in ("transpose", "concatenate")
            and any(getattr(v.aval, "shape", None) == cache_shape for v in e.invars)]


@pytest.mark.parametrize("impl", ["jax", "einsum"])
def test_a_cached_step_reads_the_cache_in_place(impl):
    config = jf.llama(num_kv_heads=2, attention_impl=impl, d_model=32, num_heads=4)
    tokens = random_tokens(0, (3, 4), config.tgt_vocab_size)
    params = numpy_params(jf.DecoderOnlyLM(config), tokens)
    # (with a heads-major cache, the "jax" path transposed it to (B, T, G, K) every step)
    assert _cache_moves(config, params, tokens, max_len=11) == []


def test_a_cache_of_the_other_layout_is_refused():
    config = jf.llama(attention_impl="jax")
    other = cache_lib.init_cache(config.replace(attention_impl="einsum"), 2, 5)
    with pytest.raises(ValueError, match="init_cache"):
        cache_lib.check_cache(other, config)


@pytest.mark.parametrize("impl", ["einsum", "jax"])
def test_cached_generation_equals_full_recomputation_in_either_layout(impl):
    config = jf.llama(num_kv_heads=2, attention_impl=impl)
    model = jf.DecoderOnlyLM(config)
    prompt = random_tokens(1, (2, 5), config.tgt_vocab_size)
    params = numpy_params(model, prompt)
    out = jf.generate(model, params, prompt, max_new_tokens=6)
    seq = prompt
    for _ in range(6):  # the reference: a full forward over the growing sequence
        logits = model.apply({"params": params}, seq)
        seq = jnp.concatenate([seq, jnp.argmax(logits[:, -1], -1)[:, None]], axis=1)
    for row, length in enumerate(np.asarray(out.lengths)):  # PAD follows an EOS
        np.testing.assert_array_equal(out.tokens[row, :length], seq[row, 5:5 + length])

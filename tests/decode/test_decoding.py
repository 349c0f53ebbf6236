"""Decoding: the cached, compiled loops against full recomputation, and their contracts."""

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.decode import cache as cache_lib
from jaxformer.decode import loop as decode_loop, api as decoding, sampling
from jaxformer.backends import cpu
from jaxformer.parallel import sharding
from jaxformer.decode.inputs import left_align
from jaxformer.decode.cache import memory_cache
from jaxformer.nn.masks import causal_mask

from conftest import reference_greedy

N_NEW = 10


def _with_eos_bias(config, params, delta):
    params = jax.tree_util.tree_map(lambda x: x, params)  # a copy we may edit
    bias = params["decoder"]["out_proj"]["bias"]
    params["decoder"]["out_proj"]["bias"] = bias.at[config.eos_id].add(delta)
    return params


def _mixed_eos_params(config, model, params, src):
    """Raise the EOS bias until some rows stop mid-way and some do not (so EOS logic runs)."""
    for delta in np.linspace(0.0, 3.0, 31):
        edited = _with_eos_bias(config, params, float(delta))
        lengths = np.asarray(decoding.greedy_decode(model, edited, src,
                                                    max_new_tokens=N_NEW).lengths)
        if (lengths < N_NEW).any() and (lengths == N_NEW).any() and (lengths > 1).any():
            return edited
    pytest.fail("no EOS bias gives a mix of finished and unfinished rows")


def assert_is_reference_greedy(result, model, params, src):
    """`result` (with logits) has the tokens, lengths and logits (up to each row's
    EOS) of `reference_greedy`."""
    tokens, lengths, logits = reference_greedy(model, params, src, N_NEW)
    np.testing.assert_array_equal(result.tokens, tokens)
    np.testing.assert_array_equal(result.lengths, lengths)
    for row, length in enumerate(lengths):  # logits after EOS are not part of the contract
        np.testing.assert_allclose(result.logits[row, :length], logits[row, :length],
                                   atol=1e-5, rtol=1e-5)


def _build_encdec(norm):
    return _build_encdec_config(jf.tiny(norm=norm))


@functools.lru_cache(maxsize=None)
def _build_encdec_config(config):
    model = jf.Transformer(config)
    rng = np.random.default_rng(1)
    src = rng.integers(3, config.src_vocab_size, (5, 9)).astype(np.int32)
    src[1, 5:] = config.pad_id  # padded sources
    src[3, 2:] = config.pad_id
    src = jnp.asarray(src)
    params = model.init(jax.random.PRNGKey(0), src, src[:, :4])["params"]
    return config, model, _mixed_eos_params(config, model, params, src), src


@pytest.fixture(scope="module", params=["post", "pre"])
def encdec(request):
    """(config, model, params with a mixed-EOS bias, padded src), for both norms."""
    return _build_encdec(request.param)


@pytest.fixture(scope="module")
def encdec_post():
    """The "post" case only, for tests of the loop machinery rather than the model."""
    return _build_encdec("post")


def test_cached_greedy_equals_full_recomputation(encdec):
    config, model, params, src = encdec
    result = decoding.greedy_decode(model, params, src, max_new_tokens=N_NEW,
                                    return_logits=True)
    assert_is_reference_greedy(result, model, params, src)


def test_output_convention(encdec):
    """Tokens exclude BOS, include EOS, PAD after it; lengths count up to EOS."""
    config, model, params, src = encdec
    result = decoding.greedy_decode(model, params, src, max_new_tokens=N_NEW)
    assert result.tokens.shape == (src.shape[0], N_NEW) and result.tokens.dtype == jnp.int32
    assert result.lengths.shape == (src.shape[0],) and result.lengths.dtype == jnp.int32
    for row, length in zip(np.asarray(result.tokens), np.asarray(result.lengths)):
        eos = np.flatnonzero(row == config.eos_id)
        if length < N_NEW:
            assert eos[0] == length - 1
            assert (row[length:] == config.pad_id).all()
        else:
            assert len(eos) == 0 or eos[0] == N_NEW - 1


def test_naive_recompute_loop_agrees(encdec):
    config, model, params, src = encdec
    cached = decoding.greedy_decode(model, params, src, max_new_tokens=N_NEW)
    naive = decoding.greedy_decode_recompute(model, params, src, max_new_tokens=N_NEW)
    np.testing.assert_array_equal(cached.tokens, naive.tokens)
    np.testing.assert_array_equal(cached.lengths, naive.lengths)


def test_while_loop_equals_scan(encdec):
    config, model, params, src = encdec
    scan = decoding.greedy_decode(model, params, src, max_new_tokens=N_NEW)
    early = decoding.greedy_decode(model, params, src, max_new_tokens=N_NEW, loop="while")
    np.testing.assert_array_equal(scan.tokens, early.tokens)
    np.testing.assert_array_equal(scan.lengths, early.lengths)


def test_explicit_src_mask_equals_default(encdec_post):
    config, model, params, src = encdec_post
    default = decoding.greedy_decode(model, params, src, max_new_tokens=N_NEW)
    explicit = decoding.greedy_decode(model, params, src, max_new_tokens=N_NEW,
                                      src_mask=jf.padding_mask(src, config.pad_id))
    np.testing.assert_array_equal(default.tokens, explicit.tokens)
    seen_all = decoding.greedy_decode(model, params, src, max_new_tokens=N_NEW,
                                      src_mask=jnp.ones((src.shape[0], 1, 1, src.shape[1]), bool))
    # Letting the decoder see PAD changes the padded rows' outputs (the mask matters).
    assert not np.array_equal(default.tokens, seen_all.tokens)


def test_padding_a_source_does_not_change_its_decode(encdec_post):
    config, model, params, src = encdec_post
    row = src[1:2, :5]  # row 1 is 5 real tokens then PAD
    alone = decoding.greedy_decode(model, params, row, max_new_tokens=N_NEW)
    batched = decoding.greedy_decode(model, params, src, max_new_tokens=N_NEW)
    np.testing.assert_array_equal(alone.tokens[0], batched.tokens[1])


def test_compiled_once_per_shape(encdec_post):
    config, model, params, src = encdec_post
    decoding.greedy_decode(model, params, src, max_new_tokens=N_NEW)  # warm: compile
    before = decoding.TRACE_COUNTS["encdec"]
    other_src = jnp.flip(src, axis=0)  # same shape, new values
    for inputs in (src, other_src, src):
        decoding.greedy_decode(model, params, inputs, max_new_tokens=N_NEW)
    assert decoding.TRACE_COUNTS["encdec"] == before
    decoding.greedy_decode(model, params, src[:, :8], max_new_tokens=N_NEW)  # a new shape
    assert decoding.TRACE_COUNTS["encdec"] == before + 1


def test_cpu_tuned_decode_compiler_options_keep_the_tokens(encdec_post):
    """The loop compiled with the tuned CPU options (`backends.cpu.XLA_DOTS`: XLA's own
    dots) decodes exactly what the default compile decodes."""
    config, model, params, src = encdec_post
    ours = decoding.greedy_decode(model, params, src, max_new_tokens=N_NEW, return_logits=True)

    def one(s):
        return jf.greedy_decode_one(model, params, s, max_new_tokens=N_NEW)
    theirs = jax.jit(jax.vmap(one), compiler_options=cpu.XLA_DOTS)(src)
    np.testing.assert_array_equal(ours.tokens, theirs.tokens)
    np.testing.assert_array_equal(ours.lengths, theirs.lengths)


def test_memory_cache_repeats_each_example_for_its_beams(encdec_post):
    """`memory_cache(repeats=W)` (beam search's start) has B * W rows of self-attention
    keys and values, and example b's encoded source once, shared by rows
    b*W..b*W+W-1 (not repeated in memory: each step reads it once for the W beams)."""
    config, model, params, src = encdec_post
    once = memory_cache(model, params, src, None, N_NEW)
    thrice = memory_cache(model, params, src, None, N_NEW, repeats=3)
    assert thrice.max_len == once.max_len == N_NEW and int(thrice.index) == 0
    assert thrice.batch == 3 * once.batch
    np.testing.assert_array_equal(thrice.cross_mask, once.cross_mask)
    assert not np.all(once.cross_mask)  # the padded sources are hidden
    for ours, ref in zip(jax.tree.leaves(thrice.cross_kv), jax.tree.leaves(once.cross_kv)):
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)
    for ours, ref in zip(jax.tree.leaves(thrice.self_kv), jax.tree.leaves(once.self_kv)):
        np.testing.assert_array_equal(ours, np.repeat(ref, 3, axis=0))


def test_init_wrapper_params_are_accepted(encdec_post):
    config, model, params, src = encdec_post
    bare = decoding.greedy_decode(model, params, src, max_new_tokens=N_NEW)
    wrapped = decoding.greedy_decode(model, {"params": params}, src, max_new_tokens=N_NEW)
    np.testing.assert_array_equal(bare.tokens, wrapped.tokens)


# -- input checks: clear errors before compiling -------------------------------------


@pytest.fixture(scope="module")
def small():
    config = jf.tiny()
    model = jf.Transformer(config)
    src = jnp.full((2, 4), 5, jnp.int32)
    return config, model, model.init(jax.random.PRNGKey(0), src, src)["params"], src


@pytest.mark.parametrize("kwargs, error, match", [
    pytest.param(dict(max_new_tokens=0), ValueError, "max_new_tokens", id="zero_new_tokens"),
    pytest.param(dict(max_new_tokens=2.0), TypeError, "max_new_tokens", id="float_new_tokens"),
    pytest.param(dict(max_new_tokens=33), ValueError, "max_len", id="too_many_new_tokens"),
    pytest.param(dict(src_BS=jnp.array([[5, 16]])), ValueError, "src_BS", id="id_out_of_range"),
    pytest.param(dict(src_BS=jnp.array([[5, -1]])), ValueError, "src_BS", id="negative_id"),
    pytest.param(dict(src_BS=jnp.full((1, 33), 5)), ValueError, "src_BS", id="source_too_long"),
    pytest.param(dict(src_BS=jnp.ones((1, 3, 7))), ValueError, "d_model", id="float_ids"),
    pytest.param(dict(src_mask=jnp.ones((3, 1, 1, 4), bool)), ValueError, "src_mask",
                 id="mask_batch_mismatch"),
    pytest.param(dict(src_mask=jnp.ones((2, 1, 1, 3), bool)), ValueError, "src_mask",
                 id="mask_length_mismatch"),
    pytest.param(dict(src_mask=jnp.ones((2, 1, 1, 4))), TypeError, "src_mask",
                 id="mask_not_bool"),
    pytest.param(dict(loop="for"), ValueError, "loop", id="bad_loop"),
    pytest.param(dict(segments=0), ValueError, "segments", id="zero_segments"),
    pytest.param(dict(segments=2.0), ValueError, "segments", id="float_segments"),
])
def test_bad_inputs_raise_before_compiling(small, kwargs, error, match):
    config, model, params, src = small
    args = dict(src_BS=src, max_new_tokens=3) | kwargs
    before = dict(decoding.TRACE_COUNTS)
    with pytest.raises(error, match=match):
        decoding.greedy_decode(model, params, args.pop("src_BS"), **args)
    assert dict(decoding.TRACE_COUNTS) == before


def test_nan_parameters_are_refused_before_decoding(small):
    """NaN weights would decode to argmax-of-NaN tokens without a word."""
    config, model, params, src = small
    broken = jax.tree_util.tree_map(lambda x: x, params)
    kernel = broken["decoder"]["layers_0"]["ffn"]["wo"]["kernel"]
    broken["decoder"]["layers_0"]["ffn"]["wo"]["kernel"] = kernel.at[0, 0].set(jnp.nan)
    before = dict(decoding.TRACE_COUNTS)
    with pytest.raises(ValueError, match=r"NaN or inf values in .*'layers_0'.*'wo'"):
        decoding.greedy_decode(model, broken, src, max_new_tokens=3)
    with pytest.raises(ValueError, match="NaN or inf"):
        jf.beam_search(model, {"params": broken}, src, max_new_tokens=3, beam_size=2)
    assert dict(decoding.TRACE_COUNTS) == before
    decoding.greedy_decode(model, params, src, max_new_tokens=3)  # the intact ones decode


def test_decoder_only_model_is_refused_by_greedy_decode(small):
    config, model, params, src = small
    lm = jf.DecoderOnlyLM(config.replace(num_encoder_layers=0))
    with pytest.raises(TypeError, match="Transformer"):
        decoding.greedy_decode(lm, params, src, max_new_tokens=3)


def test_greedy_selector_is_argmax():
    logits = jnp.array([[0.1, 3.0, -1.0], [2.0, 2.0, 1.0]])
    np.testing.assert_array_equal(sampling.greedy(logits), [1, 0])


# -- vmap: one example's decode, batched by jax.vmap ------------------------------------


@pytest.mark.parametrize("loop", ["scan", "while"])
def test_vmapped_single_example_equals_batched(encdec_post, loop):
    config, model, params, src = encdec_post
    one = lambda s: decoding.greedy_decode_one(model, params, s, max_new_tokens=N_NEW,
                                               loop=loop)
    vmapped = jax.jit(jax.vmap(one))(src)
    batched = decoding.greedy_decode(model, params, src, max_new_tokens=N_NEW, loop=loop)
    np.testing.assert_array_equal(vmapped.tokens, batched.tokens)
    np.testing.assert_array_equal(vmapped.lengths, batched.lengths)
    assert vmapped.tokens.shape == (src.shape[0], N_NEW)
    # And one example alone is the row of the batch.
    single = jax.jit(one)(src[3])
    np.testing.assert_array_equal(single.tokens, batched.tokens[3])


# -- decoder-only LM with ragged prompts ------------------------------------------------


def _build_lm(norm):
    return _build_lm_config(jf.tiny(norm=norm, num_encoder_layers=0))


@functools.lru_cache(maxsize=None)
def _build_lm_config(config):
    model = jf.DecoderOnlyLM(config)
    rng = np.random.default_rng(2)
    lengths = np.array([5, 2, 7, 1])
    prompt = rng.integers(3, config.tgt_vocab_size, (4, 7)).astype(np.int32)
    prompt[np.arange(7)[None, :] >= lengths[:, None]] = config.pad_id  # right padding
    params = model.init(jax.random.PRNGKey(3), jnp.asarray(prompt))["params"]
    return config, model, params, jnp.asarray(prompt), lengths


def reference_lm_greedy(model, params, prompt, lengths, n_new):
    """Each row alone, unpadded: full forward over prompt + generated tokens every step."""
    c = model.config
    width = prompt.shape[1] + n_new
    forward = jax.jit(lambda p, t: model.apply({"params": p}, t, causal_mask(width)))
    tokens = np.full((len(lengths), n_new), c.pad_id, np.int32)
    logits_out = np.zeros((len(lengths), n_new, c.tgt_vocab_size), np.float32)
    for row, length in enumerate(lengths):
        sequence = np.full((1, width), c.pad_id, np.int32)
        sequence[0, :length] = np.asarray(prompt[row, :length])
        for step in range(n_new):
            logits = np.asarray(forward(params, jnp.asarray(sequence))[0, length - 1 + step])
            logits_out[row, step] = logits
            tokens[row, step] = logits.argmax()
            sequence[0, length + step] = tokens[row, step]
            if tokens[row, step] == c.eos_id:
                break
    return tokens, logits_out


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_lm_ragged_prompt_generate_equals_recomputation(norm):
    config, model, params, prompt, lengths = _build_lm(norm)
    result = decoding.generate(model, params, prompt, max_new_tokens=6, return_logits=True)
    tokens, logits = reference_lm_greedy(model, params, prompt, lengths, 6)
    np.testing.assert_array_equal(result.tokens, tokens)
    np.testing.assert_allclose(result.logits, logits, atol=1e-5, rtol=1e-5)
    # Explicit lengths are the same as lengths inferred from the right padding.
    explicit = decoding.generate(model, params, prompt, max_new_tokens=6,
                                 prompt_lengths=lengths, return_logits=True)
    np.testing.assert_array_equal(explicit.tokens, result.tokens)


# The modern blocks (RoPE, RMSNorm, gated FFN, grouped-query attention): cached decoding
# equals recomputation, for both norm types, encoder-decoder and decoder-only.
MODERN_ENCDEC = {
    "pre_rmsnorm_gqa_rope_half_swiglu": jf.tiny(
        norm="pre", norm_type="rmsnorm", num_kv_heads=2, rope="half",
        encoder_positions="none", decoder_positions="none", gated_ffn=True,
        activation="silu", attention_bias=False, ffn_bias=False),
    "post_layernorm_mqa_rope_interleaved_geglu": jf.tiny(
        num_kv_heads=1, rope="interleaved", gated_ffn=True, activation="gelu"),
}
MODERN_LM = {
    "llama_rmsnorm_gqa_rope_half": jf.llama(num_heads=4, num_kv_heads=2),
    "layernorm_mqa_rope_interleaved_jax_attention": jf.llama(
        norm_type="layernorm", num_kv_heads=1, rope="interleaved", attention_impl="jax"),
}


@pytest.mark.parametrize("case", list(MODERN_ENCDEC))
def test_modern_blocks_cached_greedy_equals_recomputation(case):
    config, model, params, src = _build_encdec_config(MODERN_ENCDEC[case])
    result = decoding.greedy_decode(model, params, src, max_new_tokens=N_NEW,
                                    return_logits=True)
    assert_is_reference_greedy(result, model, params, src)


@pytest.mark.parametrize("case", list(MODERN_LM))
def test_modern_blocks_ragged_prompt_generate_equals_recomputation(case):
    """RoPE positions come from the cache's per-row start: each row as if alone."""
    config, model, params, prompt, lengths = _build_lm_config(MODERN_LM[case])
    result = decoding.generate(model, params, prompt, max_new_tokens=6, return_logits=True)
    tokens, logits = reference_lm_greedy(model, params, prompt, lengths, 6)
    np.testing.assert_array_equal(result.tokens, tokens)
    np.testing.assert_allclose(result.logits, logits, atol=1e-5, rtol=1e-5)


# Segments: the loop in several parts over a chunked cache (`cache.fold`), each
# attending over the slots written so far. Same tokens as one loop, and as
# recomputation; N = 10 in 3 segments is 4 + 3 + 3 steps.


@pytest.mark.parametrize("loop", ["scan", "while"])
def test_segmented_decode_equals_recomputation(encdec, loop):
    config, model, params, src = encdec
    result = decoding.greedy_decode(model, params, src, max_new_tokens=N_NEW, loop=loop,
                                    return_logits=True, segments=3)
    assert_is_reference_greedy(result, model, params, src)


@pytest.mark.parametrize("case", list(MODERN_ENCDEC))
def test_segmented_modern_blocks_equal_one_segment(case):
    """Grouped-query attention over a cache in parts, RoPE positions across folds."""
    config, model, params, src = _build_encdec_config(MODERN_ENCDEC[case])
    one, three = (decoding.greedy_decode(model, params, src, max_new_tokens=N_NEW,
                                         return_logits=True, segments=s) for s in (1, 3))
    np.testing.assert_array_equal(three.tokens, one.tokens)
    np.testing.assert_allclose(three.logits, one.logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["post", *MODERN_LM])
def test_segmented_generate_equals_recomputation(case):
    """Ragged prompts: the prefill becomes the past, the 5 later steps run as 2 + 2 + 1."""
    config, model, params, prompt, lengths = (
        _build_lm(case) if case == "post" else _build_lm_config(MODERN_LM[case]))
    result = decoding.generate(model, params, prompt, max_new_tokens=6, return_logits=True,
                               segments=3)
    tokens, logits = reference_lm_greedy(model, params, prompt, lengths, 6)
    np.testing.assert_array_equal(result.tokens, tokens)
    np.testing.assert_allclose(result.logits, logits, atol=1e-5, rtol=1e-5)


def test_segments_fold_the_cache_between_loops():
    """Each segment's step sees the slots written before it as the past and a chunk of
    its own length: the loop reads what was written, not all N slots."""
    config = jf.tiny()
    seen = []

    def logits_fn(token_B, cache, step):  # runs at trace time: once per segment
        seen.append((cache.past_len, cache.max_len - cache.past_len))
        return jnp.zeros((2, config.tgt_vocab_size)), cache.replace(index=cache.index + 1)

    state = decode_loop.init_state(jnp.ones((2,), jnp.int32),
                                   cache_lib.init_cache(config, 2, 4), N_NEW, pad_id=0)
    for loop in ("scan", "while"):
        seen.clear()
        out = decode_loop.decode_loop(logits_fn, state, N_NEW, eos_id=2, pad_id=0, loop=loop,
                                      segments=3, fold=cache_lib.fold)
        assert seen == [(0, 4), (4, 3), (7, 3)] and int(out.step) == N_NEW
    assert decode_loop.segment_lengths(10, 3) == (4, 3, 3)
    assert decode_loop.segment_lengths(2, 5) == (1, 1)  # never an empty segment


def test_segments_are_one_unless_asked_for():
    """One loop over the whole cache on every backend; more only when given (or in a
    process that asked for CPU tuning: tests/backends/test_cpu.py)."""
    assert [decode_loop.segments_for(n) for n in (10, 64, 128, 4096)] == [1, 1, 1, 1]
    assert decode_loop.segments_for(10, 5) == 5
    with pytest.raises(ValueError, match="segments"):
        decode_loop.segments_for(10, 0)


def test_lm_while_equals_scan_and_padding_width_does_not_matter():
    config, model, params, prompt, lengths = _build_lm("post")
    scan = decoding.generate(model, params, prompt, max_new_tokens=6)
    early = decoding.generate(model, params, prompt, max_new_tokens=6, loop="while")
    np.testing.assert_array_equal(scan.tokens, early.tokens)
    wider = jnp.pad(prompt, ((0, 0), (0, 3)), constant_values=config.pad_id)
    np.testing.assert_array_equal(
        decoding.generate(model, params, wider, max_new_tokens=6).tokens, scan.tokens)


@pytest.mark.parametrize("kwargs, match", [
    pytest.param(dict(max_new_tokens=0), "max_new_tokens", id="zero_new_tokens"),
    pytest.param(dict(max_new_tokens=27), "max_len", id="prompt_plus_new_too_long"),
    pytest.param(dict(prompt_lengths=np.array([5, 2, 8, 1])), "prompt_lengths",
                 id="length_beyond_width"),
    pytest.param(dict(prompt_lengths=np.array([5, 2, 0, 1])), "prompt_lengths",
                 id="empty_prompt"),
    pytest.param(dict(prompt_lengths=np.array([5, 2, 7])), "prompt_lengths",
                 id="lengths_batch_mismatch"),
    pytest.param(dict(prompt_BP=jnp.array([[5, 0, 6]])), "PAD", id="pad_inside_prompt"),
    pytest.param(dict(prompt_BP=jnp.array([[5, 16]])), "prompt_BP", id="id_out_of_range"),
    pytest.param(dict(temperature=1.0), "rng", id="sampling_without_rng"),
    pytest.param(dict(temperature=float("nan"), rng=jax.random.PRNGKey(0)), "temperature",
                 id="nan_temperature"),  # it sampled PAD everywhere (issue 47)
])
def test_lm_bad_inputs_raise_before_compiling(kwargs, match):
    config, model, params, prompt, lengths = _build_lm("post")
    args = dict(prompt_BP=prompt, max_new_tokens=3) | kwargs
    before = dict(decoding.TRACE_COUNTS)
    with pytest.raises((ValueError, TypeError), match=match):
        decoding.generate(model, params, args.pop("prompt_BP"), **args)
    assert dict(decoding.TRACE_COUNTS) == before


def test_left_align():
    prompt = jnp.array([[5, 6, 7, 0], [8, 0, 0, 0], [3, 4, 5, 6]])
    np.testing.assert_array_equal(
        left_align(prompt, jnp.array([3, 1, 4]), pad_id=0),
        [[0, 5, 6, 7], [0, 0, 0, 8], [3, 4, 5, 6]])


def test_batched_decoding_example_runs_and_agrees(capsys):
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).parents[2] / "examples" / "batched_decoding.py"
    spec = importlib.util.spec_from_file_location("batched_decoding_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main() is True
    assert "vmap == batched: True   vmap == one-by-one: True" in capsys.readouterr().out


DATA_PARALLEL_DECODE = """
import jax
from jaxformer.parallel import partitioning, sharding
sharding.use_cpu_cores_as_devices(2)  # right after `import jax`, as documented
import json
import jax.numpy as jnp
import numpy as np
import jaxformer as jf
from jaxformer.decode import api as decoding
from jaxformer.decode.beam import beam_search

mesh = partitioning.make_mesh()
split = lambda x: sharding.shard_batch(x, mesh)
config = jf.tiny()
model = jf.Transformer(config)
rng = np.random.default_rng(5)
src = rng.integers(3, config.src_vocab_size, (6, 9)).astype(np.int32)
src[1, 5:] = config.pad_id
src = jnp.asarray(src)
params = model.init(jax.random.PRNGKey(0), src, src[:, :4])["params"]
bias = params["decoder"]["out_proj"]["bias"]
params["decoder"]["out_proj"]["bias"] = bias.at[config.eos_id].add(1.5)  # some rows stop early
everywhere = sharding.replicate(params, mesh)
one = decoding.greedy_decode(model, params, src, max_new_tokens=10, return_logits=True)
two = decoding.greedy_decode(model, everywhere, split(src), max_new_tokens=10,
                             return_logits=True)
two_while = decoding.greedy_decode(model, everywhere, split(src), max_new_tokens=10,
                                   loop="while")
two_recompute = decoding.greedy_decode_recompute(model, everywhere, split(src),
                                                 max_new_tokens=10)
key = jax.random.PRNGKey(11)
sampled_one = decoding.sample(model, params, src, max_new_tokens=10, rng=key, top_k=8)
sampled_two = decoding.sample(model, everywhere, split(src), max_new_tokens=10, rng=key, top_k=8)
sampled_other_key = decoding.sample(model, everywhere, split(src), max_new_tokens=10,
                                    rng=jax.random.PRNGKey(12), top_k=8)
beam_one = beam_search(model, params, src, max_new_tokens=10, beam_size=3)
beam_two = beam_search(model, everywhere, split(src), max_new_tokens=10, beam_size=3)

lm = jf.DecoderOnlyLM(jf.tiny(num_encoder_layers=0))
prompt = rng.integers(3, lm.config.tgt_vocab_size, (4, 7)).astype(np.int32)
lengths = np.array([5, 2, 7, 1], np.int32)
prompt[np.arange(7)[None, :] >= lengths[:, None]] = 0
lm_params = lm.init(jax.random.PRNGKey(3), jnp.asarray(prompt))["params"]
lm_one = decoding.generate(lm, lm_params, prompt, max_new_tokens=6, return_logits=True)
lm_two = decoding.generate(lm, sharding.replicate(lm_params, mesh), split(jnp.asarray(prompt)),
                           max_new_tokens=6, prompt_lengths=lengths, return_logits=True)
try:
    sharding.use_cpu_cores_as_devices(3)
    late = None
except RuntimeError as e:
    late = str(e)
print(json.dumps({
    "devices": len(jax.devices()),
    "shard_rows": sorted(s.data.shape[0] for s in two.tokens.addressable_shards),
    "lengths": np.asarray(one.lengths).tolist(),
    "tokens_one": np.asarray(one.tokens).tolist(), "tokens_two": np.asarray(two.tokens).tolist(),
    "tokens_two_while": np.asarray(two_while.tokens).tolist(),
    "tokens_two_recompute": np.asarray(two_recompute.tokens).tolist(),
    "logits_diff": float(np.abs(np.asarray(one.logits) - np.asarray(two.logits)).max()),
    "sampled_one": np.asarray(sampled_one.tokens).tolist(),
    "sampled_two": np.asarray(sampled_two.tokens).tolist(),
    "sampled_rows": sorted(s.data.shape[0] for s in sampled_two.tokens.addressable_shards),
    "sampled_other_key": np.asarray(sampled_other_key.tokens).tolist(),
    "beam_one": np.asarray(beam_one.tokens).tolist(),
    "beam_two": np.asarray(beam_two.tokens).tolist(),
    "beam_rows": sorted(s.data.shape[0] for s in beam_two.tokens.addressable_shards),
    "beam_scores_diff": float(np.abs(np.asarray(beam_one.scores)
                                     - np.asarray(beam_two.scores)).max()),
    "lm_tokens_one": np.asarray(lm_one.tokens).tolist(),
    "lm_tokens_two": np.asarray(lm_two.tokens).tolist(),
    "lm_logits_diff": float(np.abs(np.asarray(lm_one.logits) - np.asarray(lm_two.logits)).max()),
    "late": late}))
"""


def test_data_parallel_decode_over_cpu_cores_equals_one_device():
    """A batch split over 2 CPU devices decodes to the tokens of the whole batch on one."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=repo)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", DATA_PARALLEL_DECODE], env=env, cwd=repo,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 2 and out["shard_rows"] == [3, 3]  # really split over 2
    assert min(out["lengths"]) < 10 <= max(out["lengths"])  # EOS handling is exercised
    assert out["tokens_two"] == out["tokens_one"]
    assert out["tokens_two_while"] == out["tokens_one"]
    assert out["tokens_two_recompute"] == out["tokens_one"]
    assert out["logits_diff"] < 1e-5
    # Sampling: the same key draws the same tokens whatever the split (threefry
    # keys are partitionable); another key draws others.
    assert out["sampled_rows"] == [3, 3] and out["sampled_two"] == out["sampled_one"]
    assert out["sampled_other_key"] != out["sampled_one"]
    assert out["sampled_one"] != out["tokens_one"]  # really sampled, not greedy
    assert out["beam_rows"] == [3, 3] and out["beam_two"] == out["beam_one"]
    assert out["beam_scores_diff"] < 1e-5
    assert out["lm_tokens_two"] == out["lm_tokens_one"]
    assert out["lm_logits_diff"] < 1e-5
    assert out["late"] and "right after `import jax`" in out["late"]


@pytest.mark.parametrize("count", [0, -2, 1.5, True])
def test_use_cpu_cores_as_devices_refuses_bad_counts(count):
    with pytest.raises(ValueError, match="positive int"):
        sharding.use_cpu_cores_as_devices(count)

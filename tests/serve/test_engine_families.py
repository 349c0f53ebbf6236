"""Every decoder-only family `load` reads, served: tiny random configs of each
(`models.hf.config_from_hf` on a config.json dict, the way a user's directory is read),
through the engine with several slots, the prefix cache and speculation, on prompts
longer than the sliding window, give `generate`'s greedy tokens of each prompt alone."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.models import hf
from jaxformer.serve import Engine, Request, SamplingParams

VOCAB, WINDOW = 96, 5
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              pad_token_id=0, bos_token_id=2, eos_token_id=1, rms_norm_eps=1e-6)
FAMILIES = {
    "llama": ("LlamaForCausalLM", {}),
    "mistral": ("MistralForCausalLM", dict(sliding_window=WINDOW, head_dim=16)),
    "qwen2": ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=WINDOW,
                                       max_window_layers=1)),
    "qwen3": ("Qwen3ForCausalLM", dict(head_dim=16, tie_word_embeddings=True,
                                       use_sliding_window=True, sliding_window=WINDOW,
                                       layer_types=["sliding_attention", "full_attention"])),
    "gemma2": ("Gemma2ForCausalLM", dict(head_dim=16, query_pre_attn_scalar=16,
                                         sliding_window=WINDOW, attn_logit_softcapping=2.0,
                                         final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3ForCausalLM", dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, num_hidden_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": dict(rope_type="linear", factor=4.0,
                                                rope_theta=10000.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=100.0)})),
}
WIDTH, NEW = 24, 10  # one compiled `generate` per family for every reference


def family_config(family):
    arch, extra = FAMILIES[family]
    return hf.config_from_hf({"architectures": [arch], **COMMON, **extra})


def alone(model, params, prompt, max_tokens):
    """`generate`'s first `max_tokens` greedy tokens of `prompt` alone, before EOS."""
    row = np.zeros((1, WIDTH), np.int32)
    row[0, :len(prompt)] = prompt
    out = jf.generate(model, params, jnp.asarray(row), prompt_lengths=jnp.asarray([len(prompt)]),
                      max_new_tokens=NEW)
    tokens = [int(t) for t in out.tokens[0][:min(int(out.lengths[0]), max_tokens)]]
    eos = model.config.eos_id
    return tokens[:tokens.index(eos)] if eos in tokens else tokens


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_engine_serves_every_family_as_generate_decodes_it(make_lm, family):
    """Two slots for five requests (queueing, chunked prefill, joins while others
    decode), the first and fourth sharing an 8-token prefix (a prefix hit),
    prompt-lookup speculation;
    every prompt but one longer than the window, so a local layer reading past its
    band would change the tokens."""
    config = family_config(family)
    if family != "llama":
        assert config.sliding_window == WINDOW
    model, params = make_lm(config, seed=4)
    rng = np.random.default_rng(5)
    shared = [int(t) for t in rng.integers(3, VOCAB, 8)]
    ps = [shared + [7, 8, 9], [int(t) for t in rng.integers(3, VOCAB, 13)],
          [5, 6, 5, 6, 5, 6, 5], shared + [10, 11], [4, 3]]  # the 4th finds the 1st's pages
    news = (8, 6, 10, 9, 7)
    eng = Engine(model, params, slots=2, max_len=40, page_size=4, prefill_chunk=8,
                 speculative=2)
    handles = [eng.submit(Request(p, SamplingParams(max_tokens=n))) for p, n in zip(ps, news)]
    eng.run_until_idle()
    got = [[e.token for e in h.result(0) if e.token is not None and not e.prompt]
           for h in handles]
    want = [alone(model, params, p, n) for p, n in zip(ps, news)]
    assert got == want
    assert len({tuple(w) for w in want}) == len(want)  # not a degenerate model
    assert eng.metrics()["prefix_hit_rate"] > 0
    assert eng.metrics()["free_pages"] == eng.metrics()["total_pages"]


def test_scanned_serving_of_mixed_layer_kinds_is_refused_by_name(make_lm):
    model, params = make_lm(family_config("gemma3"))
    with pytest.raises(ValueError, match="mixes local and global layers: serve it unrolled"):
        Engine(model, params, slots=1, max_len=32, page_size=4, scan_layers=True)

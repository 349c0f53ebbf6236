"""Tiny random configs of every decoder-only family `load` reads, built from config.json
dicts by `models.hf.config_from_hf` (the way a user's directory is read), and greedy
`generate` of one prompt alone at a fixed width (one compile per config)."""

import jax.numpy as jnp
import numpy as np

import jaxformer as jf
from jaxformer.models import hf

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
WIDTH, NEW = 24, 10  # one compiled `generate` per config for every reference


def family_config(family, **changes):
    """The family's tiny config, from a config.json dict with `changes` merged in."""
    arch, extra = FAMILIES[family]
    return hf.config_from_hf({"architectures": [arch], **COMMON, **extra, **changes})


def alone(model, params, prompt, max_tokens):
    """`generate`'s first `max_tokens` greedy tokens of `prompt` alone, before EOS."""
    row = np.zeros((1, WIDTH), np.int32)
    row[0, :len(prompt)] = prompt
    out = jf.generate(model, params, jnp.asarray(row), prompt_lengths=jnp.asarray([len(prompt)]),
                      max_new_tokens=NEW)
    tokens = [int(t) for t in out.tokens[0][:min(int(out.lengths[0]), max_tokens)]]
    eos = model.config.eos_id
    return tokens[:tokens.index(eos)] if eos in tokens else tokens

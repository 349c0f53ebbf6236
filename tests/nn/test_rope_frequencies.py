"""RoPE inverse frequencies equal transformers' bit for bit: the reference every imported
checkpoint is compared with (an ulp off in a frequency moves cos/sin by ~1e-5 at
position 255, and lm-eval's log-likelihoods by ~1e-5)."""

import numpy as np
import pytest

from jaxformer.nn.rope import rope_frequencies, scaled_frequencies

pytest.importorskip("torch", reason="the reference is transformers (torch)")
pytest.importorskip("transformers", reason="the reference is transformers")

CASES = {  # name: (head_dim, theta, rope_parameters beyond rope_type / rope_theta)
    "smollm2_64_1e5": (64, 100000.0, dict(rope_type="default")),
    "llama2_128_1e4": (128, 10000.0, dict(rope_type="default")),
    "odd_theta_32_12345.678": (32, 12345.678, dict(rope_type="default")),  # theta not a float32
    "linear_64_1e4": (64, 10000.0, dict(rope_type="linear", factor=4.0)),
    "llama3_128_5e5": (128, 500000.0, dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
}


def transformers_inv_freq(head_dim, theta, rope):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=16384,
                         rope_parameters=dict(rope, rope_theta=theta))
    return LlamaRotaryEmbedding(config).inv_freq.numpy()


@pytest.mark.parametrize("name", sorted(CASES))
def test_inverse_frequencies_equal_transformers_bit_for_bit(name):
    head_dim, theta, rope = CASES[name]
    kind = None if rope["rope_type"] == "default" else rope["rope_type"]
    ours = scaled_frequencies(rope_frequencies(head_dim, theta), kind, rope.get("factor", 1.0),
                              rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0),
                              rope.get("original_max_position_embeddings", 8192))
    want = transformers_inv_freq(head_dim, theta, rope)
    assert ours.dtype == np.float32 and ours.shape == want.shape
    differ = np.flatnonzero(ours != want)
    assert differ.size == 0, (differ, ours[differ], want[differ])

"""A sliding-window model for the serving benchmark (`benchmarks/serve.py --window-model`):
Gemma 3 270M's shape (18 layers, every sixth global, the others local over a window of
128 positions here (the real model: 512), so that the benchmark's prompts of 20-250
tokens plus 64-128 new ones run past it; d_model 640, 4 query heads and 1 key/value
head of 256, d_ff 2048), random weights, SmolLM2's vocabulary (49152 tokens), written
as float32 GGUF by `jaxformer.models.gguf_export.save_gguf` and quantized to Q4_K_M by
llama.cpp (`llamacpp_reference.requantized_file`: Q4_K / Q6_K where a kernel's input is
a multiple of 256, Q5_0 / Q8_0 for the 640-wide inputs, as the real model's file).
Made once, in --work; needs llama-cpp-python's Python package and libllama.so
(benchmarks/llamacpp_reference.py says how).
"""

from __future__ import annotations

import os

import llamacpp_reference as ref

WINDOW = 128


def window_config(vocab: int):
    from jaxformer.models import hf  # noqa: PLC0415

    return hf.config_from_hf({
        "architectures": ["Gemma3ForCausalLM"], "vocab_size": vocab, "hidden_size": 640,
        "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 32768,
        "query_pre_attn_scalar": 256, "sliding_window": WINDOW, "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh", "pad_token_id": 0, "bos_token_id": 1,
        "eos_token_id": 2,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                        for i in range(18)],
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default",
                                                  "rope_theta": 10000.0}}})


def window_gguf(work: str, vocab_from: str) -> str:
    """The Q4_K_M file (made once in `work`)."""
    out = os.path.join(work, "gemma3-window-q4_k_m.gguf")
    if os.path.exists(out):
        return out
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    import jaxformer as jf  # noqa: PLC0415
    from jaxformer.models import gguf_export  # noqa: PLC0415
    from jaxformer.text import checkpoint_tokenizer  # noqa: PLC0415

    config = window_config(checkpoint_tokenizer(vocab_from).get_vocab_size())
    gguf_export.check_llama_cpp_shape(config, "gemma3")
    params = jax.jit(jf.DecoderOnlyLM(config).init)(jax.random.key(0),
                                                    jnp.ones((1, 1), jnp.int32))["params"]
    os.makedirs(work, exist_ok=True)
    source = os.path.join(work, "gemma3-window-f32.gguf")
    if not os.path.exists(source):
        gguf_export.save_gguf(config, params, source, arch="gemma3", vocab_from=vocab_from)
    made = ref.requantized_file(source, work, "Q4_K_M")
    os.replace(made, out)
    os.remove(source)
    return out

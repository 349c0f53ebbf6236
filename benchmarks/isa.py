"""`--isa avx2`: a benchmark run on this CPU as an AVX2-only CPU (an AMD EPYC of the
Zen 2 kind: no AVX-512, no VNNI) runs it. XLA compiles for AVX2 at most
(`--xla_cpu_max_isa=AVX2`) and the quantized kernel is built for `-march=haswell`
(`JAXFORMER_KERNEL_ARCH`), in this process and the servers it starts. The peer is
given the same way: a llama.cpp built with `-DGGML_NATIVE=OFF -DGGML_AVX2=ON
-DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF` (its `llama-server`, or its `libllama` for
llama-cpp-python), passed as the benchmark's peer. Set before JAX starts."""

from __future__ import annotations

import argparse
import os

CHOICES = ("native", "avx2")


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--isa", choices=CHOICES, default="native",
                        help="avx2: XLA and the kernel limited to AVX2 (give the peer an "
                             "AVX2-only llama.cpp build too); default native")


def apply(isa: str) -> None:
    """The environment of an `isa` run, for this process (before JAX starts) and its
    children."""
    if isa == "avx2":
        os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"),
                                                         "--xla_cpu_max_isa=AVX2"]))
        os.environ["JAXFORMER_KERNEL_ARCH"] = "haswell"

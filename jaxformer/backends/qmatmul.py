"""The quantized CPU matmul: y (B, N) = x (B, K) W (K, N) for `jaxformer.nn.quant`'s
layouts, a C++ kernel (`kernels/qmatmul.cc`) called through `jax.ffi`.

Opt-in, part of the CPU tuning: `dot` calls it only in a process that called
`cpu.tune_process()`, and only on the CPU (`lax.platform_dependent`: a GPU or TPU
lowering holds the plain dequantize-then-dot, never a custom call). XLA:CPU turns the
plain path into a float32 copy of every kernel written and read each step; the kernel
reads each weight byte once, in the layout the parameters already have (N last: a tile
of 64 output columns reads 64 contiguous bytes of each row), and shares the tiles out
to XLA's intra-op threads. On an AVX2 CPU the 4-bit and int8_block layouts (GGUF
Q4_1, Q4_0, Q8_0) round x per block to int8 and take integer dot products, as
llama.cpp does (`integer_dot`; `kernels/qdot.h` states the rounding); from 8 rows of
x on, a transposed block layout (Q4_0, Q4_1, Q8_0) takes the rows in the lanes of 512-bit vectors on an
AVX-512 VNNI CPU (`kernels/qdot_wide.h`: a serving step's logits). GGUF's K-quants
(`nn.kquant`'s q4_k, q5_k, q6_k) take `kernels/kquant.cc`: float sums per sub-block
over the stored bytes, N-last kernels only (a K-quant tied table takes the plain path).

The build is lazy: the source ships in the package and is compiled on first use with
the system's C++ compiler (`$CXX`, else g++ or c++; -O3 -march=native, or the target
`$JAXFORMER_KERNEL_ARCH` names: `haswell` builds the AVX2 path on any x86 CPU) against
`jax.ffi.include_dir()`, into ``$XDG_CACHE_HOME/jaxformer/kernels`` (default
``~/.cache``) under a name hashed from the source, the flags, the compiler, jaxlib's
version and the CPU (as torch.utils.cpp_extension and Triton do), then loaded with
ctypes and registered. So `pip install jaxformer` stays pure Python for GPU and TPU
users and needs no wheel pipeline. No compiler, or a failed build: one warning
naming why, and the plain path.

Pieces::

    FORMATS                       the layouts the kernel reads
    build(target) -> path         the library compiled for a -march target (not loaded)
    enabled() -> bool             tuned process and the kernel built (builds it once)
    library() -> path | None      the built shared library (building it if needed)
    integer_dot(fmt, transposed, block) -> bool   whether x is rounded to int8 per block
    matmul(x, parts, fmt, block, transposed=False)   the kernel: x (B, K) -> (B, N) float32
    dot(x, parts, fmt, block, plain, transposed=False)  matmul on a tuned CPU, else plain
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxformer.backends import cpu

# kernels/kquant.cc (N-last kernels only): each K-quant's parts in its arguments' order.
K_PARTS = {"q4_k": ("q", "scale", "min", "sub_scale", "sub_min"),
           "q5_k": ("q", "q_high", "scale", "min", "sub_scale", "sub_min"),
           "q6_k": ("q", "q_high", "scale", "sub_scale")}
K_FORMATS = tuple(K_PARTS)
FORMATS = ("int8", "int8_block", "int4", "int4_sym") + K_FORMATS
KERNELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels")
SOURCE = os.path.join(KERNELS, "qmatmul.cc")
# Built into the same library: the paged attention of a serving step
# (`backends.paged_attention`), target PAGED_TARGET.
SOURCES = (SOURCE, os.path.join(KERNELS, "paged_attention.cc"),
           os.path.join(KERNELS, "kquant.cc"))
HEADERS = (os.path.join(KERNELS, "qtypes.h"),  # included by SOURCES: part of the cache key
           os.path.join(KERNELS, "qdot.h"),
           os.path.join(KERNELS, "qdot_wide.h"),
           os.path.join(KERNELS, "parallel.h"))
PAGED_TARGET = ("jaxformer_paged_attention", "JaxformerPagedAttention")
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-w")
ARCH_VARIABLE = "JAXFORMER_KERNEL_ARCH"  # gcc's -march target; native by default
TARGETS = {"int8": ("jaxformer_qmatmul_int8", "JaxformerQmatmulInt8"),
           "int8_block": ("jaxformer_qmatmul_int8_block", "JaxformerQmatmulInt8Block"),
           "int4": ("jaxformer_qmatmul_int4", "JaxformerQmatmulInt4"),
           "int4_sym": ("jaxformer_qmatmul_int4_sym", "JaxformerQmatmulInt4Sym"),
           "q4_k": ("jaxformer_qmatmul_q4_k", "JaxformerQmatmulQ4K"),
           "q5_k": ("jaxformer_qmatmul_q5_k", "JaxformerQmatmulQ5K"),
           "q6_k": ("jaxformer_qmatmul_q6_k", "JaxformerQmatmulQ6K")}
_STATE = {"tried": False, "path": None, "integer": False}
_LOCK = threading.Lock()


def _compiler() -> Optional[str]:
    """$CXX as given, else the first of g++ and c++ on the PATH; None if neither."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"]) or os.environ["CXX"]
    return shutil.which("g++") or shutil.which("c++")


def _cpu_id() -> str:
    """The CPU's model and feature flags (-march=native code runs only on such a CPU)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f
                     if line.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxformer", "kernels")


def arch() -> str:
    """The -march target of the build: `$JAXFORMER_KERNEL_ARCH` (e.g. haswell: AVX2 without
    VNNI or AVX-512, the path of CPUs without them, built and tested on any x86 CPU), else
    native. Raises RuntimeError for a name gcc could not take as one word."""
    name = os.environ.get(ARCH_VARIABLE, "") or "native"
    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise RuntimeError(f"{ARCH_VARIABLE}={name!r} is not a -march target name")
    return name


def build(target: Optional[str] = None) -> str:
    """The path of the library built for -march `target` (default `arch()`), compiled
    unless the cache holds it; not loaded (a target this CPU lacks may be built, not run).
    Raises RuntimeError naming why it cannot be built."""
    flags = (f"-march={target or arch()}", *FLAGS)
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"the C++ compiler {cxx!r} does not run ({e})") from None
    source = b""
    for name in (*SOURCES, *HEADERS):
        with open(name, "rb") as f:
            source += f.read() + b"\0"
    key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), repr(version).encode(),
                                     jax.lib.__version__.encode(), _cpu_id().encode()]))
    folder = _cache_dir()
    path = os.path.join(folder, f"qmatmul-{key.hexdigest()[:20]}.so")
    if os.path.exists(path):
        return path
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        out = subprocess.run([cxx, *flags, "-I", jax.ffi.include_dir(), *SOURCES, "-o", tmp],
                             capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            last = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
            raise RuntimeError(f"{cxx} failed: {last}")
        os.replace(tmp, path)  # atomic: a concurrent build finds a whole file or none
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"{cxx} failed: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def library() -> Optional[str]:
    """The kernel's shared library, built, loaded and registered on the first call;
    None (after one warning naming why) when it cannot be."""
    with _LOCK:
        if not _STATE["tried"]:
            _STATE["tried"] = True
            try:
                path = build()
                lib = ctypes.cdll.LoadLibrary(path)
                for name, symbol in (*TARGETS.values(), PAGED_TARGET):
                    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)),
                                                platform="cpu")
                _STATE["integer"] = bool(lib.jaxformer_qmatmul_integer_dot())
                _STATE["path"] = path
            except (RuntimeError, OSError, AttributeError) as e:
                warnings.warn(f"jaxformer: the quantized CPU kernel is not available ({e}); "
                              "quantized layers use the plain dequantize-then-dot path",
                              RuntimeWarning, stacklevel=2)
        return _STATE["path"]


def integer_dot(fmt: str, transposed: bool, block: int) -> bool:
    """Whether the built kernel computes `fmt` with integer dot products (`kernels/qdot.h`:
    x rounded per block to int8 first, llama.cpp's scheme): an AVX2 build, the 4-bit
    and int8_block layouts (transposed: block % 32 == 0). False before `library()` has
    built it."""
    if not _STATE["integer"]:
        return False
    if fmt in ("int4", "int4_sym"):
        return not transposed or block % 32 == 0
    return fmt == "int8_block" and (not transposed or block % 32 == 0)


def enabled() -> bool:
    """Whether `dot` calls the kernel: a tuned process (`cpu.tune_process()`) whose
    kernel is built (the build is tried on the first call only)."""
    return cpu.process_tuned() and library() is not None


def matmul(x: jnp.ndarray, parts: dict, fmt: str, block: int,
           transposed: bool = False) -> jnp.ndarray:
    """x (B, K) float32 times the (K, N) kernel of `parts` (`jaxformer.nn.quant`'s
    {"q", "scale"[, "offset"]} quantized along axis 0, the output axes flattened):
    (B, N) float32. `transposed`: `parts` hold W^T, (N, K) quantized along its last
    axis (a tied embedding table). CPU only; `library()` must have been built."""
    q = parts["q"]
    n = q.shape[0] if transposed else int(np.prod(q.shape[1:], dtype=np.int64))
    matrix = (n, -1) if transposed else (-1, n)  # q and the block scales as 2-D arrays
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    if fmt in K_FORMATS:  # every part as 2-D (rows, N)
        call = jax.ffi.ffi_call(TARGETS[fmt][0], out, vmap_method="sequential")
        return call(x, *(parts[part].reshape(matrix) for part in K_PARTS[fmt]))
    args = [x, q.reshape(matrix)]
    if fmt == "int8":
        args.append(parts["scale"].astype(jnp.float32).reshape(n))
    else:
        args += [parts[part].reshape(matrix) for part in ("scale", "offset") if part in parts]
    call = jax.ffi.ffi_call(TARGETS[fmt][0], out, vmap_method="sequential")
    return call(*args, block=np.int64(block), transposed=bool(transposed))


def dot(x: jnp.ndarray, parts: dict, fmt: str, block: int,
        plain: Callable[[jnp.ndarray, dict], jnp.ndarray], transposed: bool = False
        ) -> jnp.ndarray:
    """`plain(x, parts)` (x (B, K) float32 -> (B, N) float32), computed by `matmul`
    on the CPU of a tuned process whose kernel is built; elsewhere, and in any
    lowering for another platform, `plain` itself. Gradients are `plain`'s."""
    if fmt not in FORMATS or x.dtype != jnp.float32 or not enabled() or (
            transposed and fmt in K_FORMATS):
        return plain(x, parts)

    @jax.custom_vjp
    def kernel(x, parts):
        return matmul(x, parts, fmt, block, transposed)

    def forward(x, parts):
        return kernel(x, parts), (x, parts)

    def backward(residuals, g):
        return jax.vjp(plain, *residuals)[1](g)

    kernel.defvjp(forward, backward)
    return lax.platform_dependent(x, parts, cpu=kernel, default=plain)

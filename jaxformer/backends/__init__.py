"""Opt-in tuning for one backend. Nothing here runs unless asked for.

`cpu`: XLA:CPU speed-ups (allocator, dispatch, fusion-steering conditionals,
a layout VJP, fused threefry, decode compiler options), gated so a GPU or TPU
lowering never contains them.

`qmatmul`: the quantized matmul of a tuned CPU process, a C++ kernel
(`kernels/qmatmul.cc`) through `jax.ffi`, compiled on first use.

`paged_attention`: a tuned CPU process's attention of a serving step, read in place
from the page pool (`kernels/paged_attention.cc`, built into the same library).
"""

__all__ = ["cpu", "paged_attention", "qmatmul", "threefry"]

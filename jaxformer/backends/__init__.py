"""Opt-in tuning for one backend. Nothing here runs unless asked for.

`cpu`: XLA:CPU speed-ups (allocator, dispatch, fusion-steering conditionals,
a layout VJP, fused threefry, decode compiler options), gated so a GPU or TPU
lowering never contains them.
"""

__all__ = ["cpu", "threefry"]

"""Tolerances from float32's rounding over the sums involved, not from one machine's run.

Two float32 computations of the same log-probability differ when they round its sums in
different orders: another batch shape or padding (XLA tiles each dot by its shapes), a
packed row, another library, another CPU's vector width (AVX2's 8 lanes against
AVX-512's 16). Each addition rounds to within half an ulp, an error uniform in
+-EPS32/2 of the partial sum (standard deviation EPS32/sqrt(12) of it); taking the
partial sums at the size of the logits and the errors as independent, a sum over
`tokens` log-probabilities, each through `additions` roundings in either computation,
differs by a normal variable of standard deviation
EPS32/sqrt(12) * scale * sqrt(2 * additions * tokens). The bounds are SIGMAS of those.
"""

import math

EPS32 = 2.0 ** -23  # float32's unit roundoff times 2 (np.finfo(np.float32).eps)
SIGMAS = 6


def decoder_additions(d_model: int, d_ff: int, head_dim: int, layers: int, context: int,
                      vocab: int) -> int:
    """The additions one logit of a pre-norm decoder passes through: per layer two
    norms', the q, k, v and output projections' and the MLP's gate and up sums
    (d_model each), its down projection's (d_ff), the attention scores' (head_dim) and
    the softmax's and weighted values' (context each); then the final norm, the output
    projection (d_model each) and the log-softmax's sum over the vocabulary."""
    per_layer = 8 * d_model + d_ff + head_dim + 2 * context
    return layers * per_layer + 2 * d_model + vocab


def logprob_sum_atol(scale: float, additions: int, tokens: int) -> float:
    """SIGMAS standard deviations of the difference between two float32 computations of
    a sum of `tokens` log-probabilities from logits of size up to `scale` (module
    docstring)."""
    return SIGMAS * EPS32 / math.sqrt(12) * scale * math.sqrt(2 * additions * tokens)


def is_near_tie(logits_V, first: int, second: int, relative: float) -> bool:
    """Whether ids `first` and `second` are within `relative` of the row's largest |logit|
    of each other: a pair that two computations differing by that much (an int8-rounded
    activation, another CPU's float rounding) may rank either way."""
    scale = float(max(abs(float(v)) for v in (max(logits_V), min(logits_V))))
    return abs(float(logits_V[first]) - float(logits_V[second])) <= relative * scale

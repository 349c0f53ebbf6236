"""What a language model must beat, in bits per byte of the same held-out text.

    unigram_bits_per_byte(text)   entropy of the text's own byte histogram: the
                                  best any order-0 (context-free) byte model can
                                  do on it, even one fitted to the text itself
    xz_bits_per_byte(text)        xz (LZMA2, preset 9 extreme) output bits per
                                  input byte: a general-purpose compressor

A model's held-out bits per byte (`jaxformer.train.evaluate_lm`) is its cross-entropy
in bits over the bytes it predicted, so the three numbers are comparable.
"""

from __future__ import annotations

import lzma

import numpy as np


def unigram_bits_per_byte(text: bytes) -> float:
    if not text:
        raise ValueError("the held-out text is empty")
    counts = np.bincount(np.frombuffer(text, np.uint8), minlength=256).astype(np.float64)
    probs = counts[counts > 0] / len(text)
    return float(-(probs * np.log2(probs)).sum())


def xz_bits_per_byte(text: bytes) -> float:
    if not text:
        raise ValueError("the held-out text is empty")
    return 8.0 * len(lzma.compress(text, preset=9 | lzma.PRESET_EXTREME)) / len(text)

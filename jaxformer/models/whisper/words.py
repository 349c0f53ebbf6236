"""Word-level timestamps: the cross-attention of the alignment heads over one window's
text tokens, median-filtered, aligned to the audio frames by dynamic time warping,
and cut into words, as openai-whisper's `timing.py` and faster-whisper compute them.

    heads = alignment_heads(model_dir, w)            # [(layer, head)] of the checkpoint
    words = align_words(w, heads, features_TM, prompt, text_ids, frames)
    # [Word(word=" quick", start=0.42, end=0.7, probability=0.93), ...], seconds from the window

One extra forward per window over `<|startoftranscript|> ... <|notimestamps|>`,
the text tokens and `<|endoftext|>` (never inside the decode loop) gives each
text token's probability and the attention weights (`nn.inspection.capture`).
The alignment heads' weights over the window's audio frames are standardised per
frame over the tokens, median-filtered along time (width 7), averaged over the
heads; the DTW path through minus that matrix says where each token starts.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import string
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.models.whisper.tokens import decode_text, tokens_of
from jaxformer.nn.inspection import capture
from jaxformer.nn.masks import causal_mask

PREPEND_PUNCTUATIONS = "\"'“¿([{-"
APPEND_PUNCTUATIONS = "\"'.。,，!！?？:：”)]}、"
MEDIAN_FILTER_WIDTH = 7
TOKENS_PER_SECOND = 50  # encoder frames per second
ALIGN_COLUMNS = 64  # the forward's token count is padded to a multiple of this


@dataclasses.dataclass(frozen=True)
class Word:
    """A word (with its leading space, as Whisper spells it), seconds from the start
    of the audio, and the mean probability of its tokens."""

    word: str
    start: float
    end: float
    probability: float


def alignment_heads(model_dir: Optional[str], num_layers: int, num_heads: int
                    ) -> tuple[tuple[int, int], ...]:
    """The checkpoint's (layer, head) pairs: `alignment_heads` of config.json
    (CTranslate2) or generation_config.json (Hugging Face); without them every head
    of the last half of the decoder layers (CTranslate2's default)."""
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name) if model_dir else ""
        if path and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                heads = json.load(f).get("alignment_heads")
            if heads:
                return tuple((int(layer), int(head)) for layer, head in heads)
    return tuple((layer, head) for layer in range(num_layers // 2, num_layers)
                 for head in range(num_heads))


def median_filter(x: np.ndarray, width: int) -> np.ndarray:
    """openai-whisper's `median_filter` along the last axis (reflect padding)."""
    if width <= 1 or x.shape[-1] <= width // 2:
        return x
    pad = width // 2
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)], mode="reflect")
    windows = np.lib.stride_tricks.sliding_window_view(padded, width, axis=-1)
    return np.sort(windows, axis=-1)[..., pad]


def dtw(cost_NM: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """openai-whisper's `dtw_cpu` (steps diagonal, down, right; ties as it breaks
    them), one anti-diagonal at a time: (text indices, time indices) of the path."""
    n, m = cost_NM.shape
    cost = np.full((n + 1, m + 1), np.inf, np.float32)
    trace = -np.ones((n + 1, m + 1), np.int8)
    cost[0, 0] = 0
    x = cost_NM.astype(np.float32)
    for d in range(2, n + m + 1):  # i + j == d, 1 <= i <= n, 1 <= j <= m
        i = np.arange(max(1, d - m), min(n, d - 1) + 1)
        j = d - i
        c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
        t = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2))
        cost[i, j] = x[i - 1, j - 1] + np.choose(t, [c0, c1, c2])
        trace[i, j] = t
    trace[0, :], trace[:, 0] = 2, 1
    i, j, path = n, m, []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        step = trace[i, j]
        i, j = (i - 1, j - 1) if step == 0 else (i - 1, j) if step == 1 else (i, j - 1)
    path = np.array(path[::-1])
    return path[:, 0], path[:, 1]


@functools.lru_cache(maxsize=8)
def _forward(model):
    def run(params, features_BTM, tokens_BT):
        logits, acts = capture(model, params, features_BTM, tokens_BT, None,
                               causal_mask(tokens_BT.shape[1]), modules=False)
        cross = [acts[f"decoder/layers_{i}/cross_attn/attention_weights"]
                 for i in range(model.config.num_decoder_layers)]
        return logits, jnp.stack(cross, axis=1)  # (B, L, H, T, S)
    return jax.jit(run)


def split_words(vocab: Sequence[str], ids: Sequence[int], eot: int,
                by_unicode: bool = False) -> tuple[list[str], list[list[int]]]:
    """openai-whisper's `split_to_word_tokens`: pieces that decode to whole
    characters, joined into words at spaces and punctuation (`by_unicode`: the
    pieces alone, for languages without spaces)."""
    full = decode_text(vocab, ids)
    pieces, piece_ids, current, offset = [], [], [], 0
    for token in ids:
        current.append(token)
        text = decode_text(vocab, current)
        if "\ufffd" not in text or full[offset + text.index("\ufffd")] == "\ufffd":
            pieces.append(text)
            piece_ids.append(current)
            current = []
            offset += len(text)
    if by_unicode:
        return pieces, piece_ids
    words, word_ids = [], []
    for piece, tokens in zip(pieces, piece_ids):
        if (tokens[0] >= eot or piece.startswith(" ") or piece.strip() in string.punctuation
                or not words):
            words.append(piece)
            word_ids.append(list(tokens))
        else:
            words[-1] += piece
            word_ids[-1].extend(tokens)
    return words, word_ids


def merge_punctuations(alignment: list[dict], prepended: str, appended: str) -> None:
    """openai-whisper's `merge_punctuations`: opening marks join the next word,
    closing marks the previous one (the emptied entries stay, with no text)."""
    i, j = len(alignment) - 2, len(alignment) - 1
    while i >= 0:
        previous, following = alignment[i], alignment[j]
        if previous["word"].startswith(" ") and previous["word"].strip() in prepended:
            following["word"] = previous["word"] + following["word"]
            following["tokens"] = previous["tokens"] + following["tokens"]
            previous["word"], previous["tokens"] = "", []
        else:
            j = i
        i -= 1
    i, j = 0, 1
    while j < len(alignment):
        previous, following = alignment[i], alignment[j]
        if not previous["word"].endswith(" ") and following["word"] in appended:
            previous["word"] = previous["word"] + following["word"]
            previous["tokens"] = previous["tokens"] + following["tokens"]
            following["word"], following["tokens"] = "", []
        else:
            i = j
        j += 1


def find_alignment(w, heads, features_TM: np.ndarray, sot_sequence: Sequence[int],
                   text_ids: Sequence[int], frames: int, by_unicode: bool = False
                   ) -> list[dict]:
    """[{word, tokens, start, end, probability}] of one window's text tokens (seconds
    from the window's start), as CTranslate2's `align` and faster-whisper's
    `find_alignment` give them; `frames`: the window's mel frames of audio."""
    if not text_ids:
        return []
    vocab, t = list(w.vocab), tokens_of(list(w.vocab))
    tokens = [*sot_sequence, t.no_timestamps, *text_ids, t.eot]
    width = -(-len(tokens) // ALIGN_COLUMNS) * ALIGN_COLUMNS
    padded = np.full((1, min(width, w.model.config.decoder_len)), t.eot, np.int32)
    padded[0, :len(tokens)] = tokens
    logits, cross = _forward(w.model)(w.params, jnp.asarray(features_TM[None], jnp.float32),
                                      jnp.asarray(padded))
    start = len(sot_sequence)  # the logits at <|notimestamps|> predict the first text token
    logits = np.asarray(logits[0, start:start + len(text_ids), :t.eot], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    text_probs = probs[np.arange(len(text_ids)), text_ids]
    cross = np.asarray(cross[0])  # (L, H, T, S)
    weights = np.stack([cross[layer, head, :len(tokens), :frames // 2]
                        for layer, head in heads]).astype(np.float64)
    weights /= weights.sum(-1, keepdims=True)  # the softmax over the window's frames only
    std, mean = weights.std(axis=-2, keepdims=True), weights.mean(axis=-2, keepdims=True)
    weights = median_filter((weights - mean) / std, MEDIAN_FILTER_WIDTH)
    matrix = weights.mean(axis=0)[start:-1]  # <|notimestamps|> and the text rows
    text_indices, time_indices = dtw(-matrix)
    words, word_tokens = split_words(vocab, [*text_ids, t.eot], t.eot, by_unicode)
    if len(word_tokens) <= 1:
        return []
    boundaries = np.pad(np.cumsum([len(x) for x in word_tokens[:-1]]), (1, 0))
    jumps = np.pad(np.diff(text_indices), (1, 0), constant_values=1).astype(bool)
    jump_times = time_indices[jumps] / TOKENS_PER_SECOND
    return [dict(word=word, tokens=tokens, start=float(s), end=float(e),
                 probability=float(np.mean(text_probs[i:j])))
            for word, tokens, s, e, i, j in zip(
                words, word_tokens, jump_times[boundaries[:-1]], jump_times[boundaries[1:]],
                boundaries[:-1], boundaries[1:])]


def window_words(alignment: list[dict], segments: list[tuple[float, float, list[int]]],
                 offset: float, eot: int, last_speech: float
                 ) -> tuple[list[tuple[float, float, list[int]]], list[list[Word]], float]:
    """faster-whisper's `add_word_timestamps` for one window: the words of
    `find_alignment` (seconds from the window at `offset`) given out to the
    window's segments, with its corrections (a word at a sentence boundary or
    after a pause is at most twice the median word duration; the segment's
    bounds follow its first and last word unless those are too long). Returns
    (segments with corrected bounds, their words, the last speech time)."""
    durations = np.array([a["end"] - a["start"] for a in alignment])
    durations = durations[durations.nonzero()]
    median = min(0.7, float(np.median(durations))) if len(durations) else 0.0
    longest = median * 2
    if len(durations):
        for i in range(1, len(alignment)):
            if alignment[i]["end"] - alignment[i]["start"] > longest:
                if alignment[i]["word"] in ".。!！?？":
                    alignment[i]["end"] = alignment[i]["start"] + longest
                elif alignment[i - 1]["word"] in ".。!！?？":
                    alignment[i]["start"] = alignment[i]["end"] - longest
    merge_punctuations(alignment, PREPEND_PUNCTUATIONS, APPEND_PUNCTUATIONS)
    out_segments, out_words, index = [], [], 0
    for start, end, ids in segments:
        n_text, saved, words = sum(1 for i in ids if i < eot), 0, []
        while index < len(alignment) and saved < n_text:
            timing = alignment[index]
            if timing["word"]:
                words.append(dict(word=timing["word"],
                                  start=round(offset + timing["start"], 2),
                                  end=round(offset + timing["end"], 2),
                                  probability=timing["probability"]))
            saved += len(timing["tokens"])
            index += 1
        if words:
            first, last = words[0], words[-1]
            if first["end"] - last_speech > median * 4 and (
                    first["end"] - first["start"] > longest or (
                        len(words) > 1 and words[1]["end"] - first["start"] > longest * 2)):
                if len(words) > 1 and words[1]["end"] - words[1]["start"] > longest:
                    boundary = max(words[1]["end"] / 2, words[1]["end"] - longest)
                    first["end"] = words[1]["start"] = boundary
                first["start"] = max(0, first["end"] - longest)
            if start < first["end"] and start - 0.5 > first["start"]:
                first["start"] = max(0, min(first["end"] - median, start))
            else:
                start = first["start"]
            if end > last["start"] and end + 0.5 < last["end"]:
                last["end"] = max(last["start"] + median, end)
            else:
                end = last["end"]
            last_speech = end
        out_segments.append((start, end, ids))
        out_words.append([Word(**x) for x in words])
    return out_segments, out_words, last_speech

"""Whisper's encoder and greedy decoding in compiled programs: encode, language
detection, and decoding after a prompt with Whisper's processors.

    ids = transcribe_ids(model, params, vocab, model_dir, features_BTM, timestamps=True)
    [(code, p)] = detect_language(model, params, vocab, features_BTM[:1])
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.decode import cache as cache_lib, sampling
from jaxformer.decode.cache import encoded_cache
from jaxformer.decode.inputs import check_encdec, decodable
from jaxformer.decode.loop import (TRACE_COUNTS, cached_logits_fn, decode_jit, decode_loop,
                                   init_state, segment_lengths, segments_for)
from jaxformer.models.whisper.beam import beam_program, check_beam, max_candidates
from jaxformer.models.whisper.config import special_ids
from jaxformer.models.whisper.rules import whisper_processors
from jaxformer.models.whisper.tokens import prompt_ids, tokens_of
from jaxformer.nn.model import Transformer

def encode(model, params, features_BTM):
    """The encoder output (B, 1500, D) of log-mel features (B, 3000, 80), jitted and
    compiled as transcription compiles it (`decode.loop.decode_jit`)."""
    return _encode_jit(model, params, features_BTM)


def _encode(model, params, features_BTM):
    return model.apply({"params": params}, features_BTM, method=Transformer.encode)


PROMPT_COLUMNS = 64  # previous-text prompts are padded to a multiple of this many tokens

_encode_jit = decode_jit(static_argnames=("model",))(_encode)


@dataclasses.dataclass(frozen=True)
class Encoded:
    """Windows already through the encoder (`encode_windows`): `generate` takes it in
    place of their features and does not run the encoder again (the temperature
    fallback decodes a window up to six times, and the encoder is most of a
    sampled pass's cost). `encoded[rows]` picks rows (a list of indices).

    memory_BSD: (B, 1500, D) encoder output.
    """

    memory_BSD: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.memory_BSD.shape)

    def __len__(self) -> int:
        return int(self.memory_BSD.shape[0])

    def __getitem__(self, rows) -> "Encoded":
        return Encoded(self.memory_BSD[jnp.asarray(rows, jnp.int32)])


def encode_windows(model, params, features_BTM) -> Encoded:
    """The encoder output of log-mel features (B, 3000, M), for `generate`."""
    return Encoded(encode(model, params, jnp.asarray(features_BTM, jnp.float32)))


def window_cache(model, params, memory_BSD, max_len: int, repeats: int = 1):
    """The decode cache over encoder output (B, 1500, D), every memory position
    visible: its cross-attention keys/values projected once per window and shared by
    its `repeats` rows (row b * repeats + r: beams, or sampled candidates)."""
    mask_B11S = jnp.ones((memory_BSD.shape[0], 1, 1, memory_BSD.shape[1]), bool)
    return encoded_cache(model, params, memory_BSD, mask_B11S, max_len, repeats=repeats)


def _first_logits(model, params, features_BTM, sot_id):
    """(B, V) logits of the token after <|startoftranscript|>."""
    memory_BSD = model.apply({"params": params}, features_BTM, method=Transformer.encode)
    tgt_B1 = jnp.full((features_BTM.shape[0], 1), sot_id, jnp.int32)
    return model.apply({"params": params}, tgt_B1, memory_BSD,
                       method=Transformer.decode)[:, 0].astype(jnp.float32)


_first_logits_jit = decode_jit(static_argnames=("model",))(_first_logits)


def language_probabilities(model, params, vocab: list[str], features_BTM
                           ) -> tuple[tuple[str, ...], np.ndarray]:
    """(codes (L,), probabilities (B, L)): the softmax of the language tokens' logits
    after <|startoftranscript|> (restricted to those tokens), as openai-whisper's and
    ctranslate2's `detect_language` compute it.

    English-only models have these tokens but were never trained on them (their
    probabilities are near-uniform); `transcribe` does not ask them.
    """
    t = tokens_of(vocab)
    logits_BV = _first_logits_jit(model, params, jnp.asarray(features_BTM, jnp.float32), t.sot)
    logits_BL = np.asarray(logits_BV)[:, list(t.language_ids)].astype(np.float64)
    probs_BL = np.exp(logits_BL - logits_BL.max(axis=1, keepdims=True))
    return t.languages, probs_BL / probs_BL.sum(axis=1, keepdims=True)


def detect_language(model, params, vocab: list[str], features_BTM
                    ) -> list[tuple[str, float]]:
    """The most probable language of each row of log-mel features (B, 3000, 80):
    [(code, probability)] (see `language_probabilities` for all of them)."""
    codes, probs_BL = language_probabilities(model, params, vocab, features_BTM)
    return [(codes[int(row.argmax())], float(row.max())) for row in probs_BL]


@dataclasses.dataclass(frozen=True)
class Generated:
    """One row's greedy decode after its prompt.

    ids: the generated ids, timestamps included, EOS excluded (ctranslate2's
      `sequences_ids`).
    no_speech_prob: the probability of <|nospeech|> (<|nocaptions|>) right after
      <|startoftranscript|>, from the unprocessed logits (openai-whisper's and
      ctranslate2's `no_speech_prob`); None if the vocabulary has no such token.
    avg_logprob: the summed log-probability of the generated tokens under the
      processed logits, EOS included, over len(ids) + 1 (openai-whisper's
      `avg_logprob`).
    """

    ids: list[int]
    no_speech_prob: Optional[float]
    avg_logprob: float


@decode_jit(static_argnames=("model", "max_new_tokens", "processors", "no_speech_id", "loop",
                             "segments", "sample", "copies"))
def _generate_program(model, params, memory_BSD, prefix_BP, rng, temperature, first_B,
                      prefix_len_B, sot_step_B, *, max_new_tokens, processors, no_speech_id,
                      loop, segments, sample, copies):
    """Greedy (or sampled) decode that also records the no-speech probability of the step fed
    <|startoftranscript|> (`sot_step_B`, 0 unless a previous-text prompt comes first) and
    the summed log-probabilities: (tokens (R, N), lengths (R,), logprob (R,), no_speech (R,)),
    R = B * copies (row b * copies + r: copy r of window b).
    `first_B`: each window's first token; `prefix_len_B`: each window's forced prefix
    length (None: all of `prefix_BP`)."""
    TRACE_COUNTS["whisper_generate"] += 1
    batch = memory_BSD.shape[0] * copies
    cache = window_cache(model, params, memory_BSD,
                         segment_lengths(max_new_tokens, segments)[0], copies)
    repeat = lambda x: None if x is None else jnp.repeat(x, copies, axis=0)  # noqa: E731
    prefix_BP, first_B, prefix_len_B, sot_step_B = (
        repeat(x) for x in (prefix_BP, first_B, prefix_len_B, sot_step_B))
    if prefix_len_B is None and prefix_BP is not None:
        prefix_len_B = jnp.full((batch,), prefix_BP.shape[1], jnp.int32)
    c = model.config
    state = init_state(first_B,
                       (cache, jnp.zeros((batch,), jnp.float32)), max_new_tokens,
                       pad_id=c.pad_id, prefix_BP=prefix_BP, prefix_len_B=prefix_len_B,
                       scores=True, rng=rng)
    step_fn = cached_logits_fn(model, params)

    def select(logits_BV, key):  # the temperature is traced: one program for all of them
        if not sample:
            return sampling.greedy(logits_BV)
        return sampling.draw(logits_BV, key, temperature)

    def logits_fn(token_B, carry, step):
        logits_BV, cache = step_fn(token_B, carry[0], step)
        logits_BV32 = logits_BV.astype(jnp.float32)
        p_B = jnp.exp(logits_BV32[:, no_speech_id] - jax.nn.logsumexp(logits_BV32, axis=-1))
        return logits_BV, (cache, jnp.where(step == sot_step_B, p_B, carry[1]))

    state = decode_loop(logits_fn, state, max_new_tokens, select=select,
                        eos_id=c.eos_id, pad_id=c.pad_id, loop=loop, processors=processors,
                        segments=segments,
                        fold=lambda carry, n: (cache_lib.fold(carry[0], n), carry[1]))
    return state.tokens_BN, state.lengths_B, state.logprob_B, state.cache[1]


def generate(model, params, vocab: list[str], features_BTM, prompts: list[list[int]], *,
             suppress_ids, suppress_ids_begin, max_text_tokens: int = 224,
             loop: str = "while", temperature: float = 0.0, seed: int = 0,
             beam_size: int = 1, patience: float = 1.0, length_penalty: float = 1.0,
             check_params: bool = True, copies: int = 1) -> list[Generated]:
    """Greedy decoding of each row after its prompt, with `whisper_processors`, in one
    compiled program. A prompt is <|startoftranscript|> and the same number of tokens
    after it in every row (language, task, <|notimestamps|>), optionally after
    <|startofprev|> and previous text (`prompt.conditioned`; then the rows' prompts
    differ in length, padded to a multiple of `PROMPT_COLUMNS`, and the prompt and
    the text together stay within the decoder's 448 positions). Returns
     each row's `Generated` ids, no-speech probability and average
    log-probability (what Whisper's no-speech rule reads). At most
    `max_text_tokens` are generated. `temperature` > 0 samples from
    softmax(logits / temperature) instead (the log-probabilities stay those of the
    unscaled logits, as openai-whisper scores a sampled window), seeded by `seed`.

    At temperature 0, `beam_size` > 1 decodes each row by beam search as
    CTranslate2 does (`beam.beam_program`: `patience` sets how many finished
    hypotheses are collected, round(beam_size * patience); the one kept has the
    highest summed log-probability / length ** `length_penalty`); the rows'
    beams are one batch of rows * beam_size. `avg_logprob` is that hypothesis's
    (faster-whisper's). The temperature > 0 ignores the beam (faster-whisper
    samples then). `check_params=False` skips the pass over the parameters that
    refuses NaN or inf (`decode.inputs.decodable`), for a caller that checked them
    once (`windows.Windows`: not once per window).

    `features_BTM`: log-mel features (B, 3000, M), or the windows' `Encoded` output
    (`encode_windows`: a caller decoding a window several times encodes it once).
    `copies` > 1 (sampling, temperature > 0): each row is decoded that many times
    from one projection of its memory (row b * copies + r of the B * copies
    results; the best of `best_of` samples)."""
    check_beam(beam_size, patience, length_penalty)
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise ValueError(f"copies must be an int >= 1, got {copies!r}")
    if copies > 1 and beam_size > 1 and float(temperature) == 0:
        raise ValueError("copies > 1 samples a row several times: it needs temperature > 0 "
                         "or beam_size=1")
    model, params = decodable(model, params) if check_params else (model, params)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            np.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if len(prompts) != features_BTM.shape[0]:
        raise ValueError(f"prompts: one per row of the features ({features_BTM.shape[0]}), "
                         f"got {len(prompts)}")
    t = tokens_of(vocab)
    starts = [p.index(t.sot) if t.sot in p else -1 for p in prompts]
    tails = {tuple(p[k + 1:]) for p, k in zip(prompts, starts)}
    if -1 in starts or len({len(tail) for tail in tails}) > 1 or len(
            {tail[-1:] == (t.no_timestamps,) for tail in tails}) > 1 or any(
            k > 0 and p[0] != vocab.index("<|startofprev|>") for p, k in zip(prompts, starts)):
        raise ValueError("prompts: each is <|startoftranscript|> (after <|startofprev|> and "
                         "previous text, or first), then tokens of one count, all ending with "
                         "<|notimestamps|> or none")
    ragged = any(starts)
    widths = [len(p) for p in prompts]
    if ragged:  # padded to a multiple of 64 columns: few programs for any previous text
        width = min(-(-(max(widths) - 1) // PROMPT_COLUMNS) * PROMPT_COLUMNS + 1,
                    model.config.decoder_len - 1)
    else:
        width = widths[0]
    # Ragged rows: one more step, for the EOS that ends a row at max_text_tokens.
    max_new_tokens = min(width - 1 + int(max_text_tokens) + ragged, model.config.decoder_len)
    prefix = None
    if width > 1:
        prefix = np.full((len(prompts), width - 1), t.eot, np.int32)
        for row, p in zip(prefix, prompts):
            row[:len(p) - 1] = p[1:]
    source = features_BTM.memory_BSD if isinstance(features_BTM, Encoded) else features_BTM
    procs, prefix_BP, _ = check_encdec(
        model, source, None, max_new_tokens=max_new_tokens, loop=loop,
        processors=whisper_processors(vocab, prompts[0][starts[0]:], suppress_ids,
                                      suppress_ids_begin, ragged=ragged,
                                      max_text=int(max_text_tokens)),
        prefix=prefix)
    no_speech = t.no_speech if t.no_speech is not None else t.eot
    encoded = (features_BTM if isinstance(features_BTM, Encoded)
               else encode_windows(model, params, features_BTM))  # after every check
    if beam_size > 1 and float(temperature) == 0 and ragged:
        # Beam search after previous text: one row at a time, its whole prompt forced
        # (BOS <|startofprev|>); a program per prompt length.
        return [beam_one(model, params, vocab, encoded[[i]], p, suppress_ids,
                         suppress_ids_begin, max_text_tokens, loop, beam_size, patience,
                         length_penalty) for i, p in enumerate(prompts)]
    if beam_size > 1 and float(temperature) == 0:
        return beam_rows(model, params, encoded, prefix_BP, procs, no_speech, t, width,
                         max_new_tokens, beam_size, patience, length_penalty)
    tokens, lengths, logprob, no_speech_p = (np.asarray(x) for x in _generate_program(
        model, params, encoded.memory_BSD, prefix_BP,
        jax.random.PRNGKey(int(seed)), jnp.float32(max(float(temperature), 1e-6)),
        jnp.asarray([p[0] for p in prompts], jnp.int32),
        jnp.asarray([w - 1 for w in widths], jnp.int32) if ragged else None,
        jnp.asarray(starts, jnp.int32),
        max_new_tokens=max_new_tokens, processors=procs, no_speech_id=no_speech, loop=loop,
        segments=segments_for(max_new_tokens), sample=float(temperature) > 0, copies=copies))
    eos = model.config.eos_id
    rows = []
    for row, length, total, p, w in zip(tokens, lengths, logprob, no_speech_p,
                                        np.repeat(widths, copies)):
        text = row[w - 1:int(length)].tolist()
        ids = text[:-1] if text and text[-1] == eos else text
        rows.append(Generated(ids, None if t.no_speech is None else float(p),
                              float(total) / (len(ids) + 1)))
    return rows


def beam_one(model, params, vocab, encoded: Encoded, prompt, suppress_ids, suppress_ids_begin,
             max_text_tokens, loop, beam_size, patience, length_penalty) -> Generated:
    """Beam search of one row after a previous-text prompt (`generate`)."""
    t = tokens_of(vocab)
    model = model.clone(config=dataclasses.replace(model.config, bos_id=int(prompt[0])))
    max_new_tokens = min(len(prompt) - 1 + int(max_text_tokens), model.config.decoder_len)
    procs, prefix_BP, _ = check_encdec(
        model, encoded.memory_BSD, None, max_new_tokens=max_new_tokens, loop=loop,
        processors=whisper_processors(vocab, prompt, suppress_ids, suppress_ids_begin),
        prefix=np.asarray([prompt[1:]], np.int32))
    no_speech = t.no_speech if t.no_speech is not None else t.eot
    return beam_rows(model, params, encoded, prefix_BP, procs, no_speech, t, len(prompt),
                     max_new_tokens, beam_size, patience, length_penalty,
                     sot_step=prompt.index(t.sot))[0]


def beam_rows(model, params, encoded: Encoded, prefix_BP, procs, no_speech, t, width,
              max_new_tokens, beam_size, patience, length_penalty,
              sot_step: int = 0) -> list[Generated]:
    tokens, lengths, total, no_speech_p = (np.asarray(x) for x in beam_program(
        model, params, encoded.memory_BSD, prefix_BP,
        max_new_tokens=max_new_tokens, processors=procs, no_speech_id=no_speech,
        beam_size=int(beam_size), max_candidates=max_candidates(beam_size, patience),
        length_penalty=float(length_penalty), sot_step=int(sot_step)))
    return [Generated(row[width - 1:width - 1 + int(n)].tolist(),
                      None if t.no_speech is None else float(p), float(s) / (int(n) + 1))
            for row, n, s, p in zip(tokens, lengths, total, no_speech_p)]


def generate_ids(model, params, vocab: list[str], features_BTM, prompts: list[list[int]], *,
                 suppress_ids, suppress_ids_begin, max_text_tokens: int = 224,
                 loop: str = "while") -> list[list[int]]:
    """The ids of `generate`: each row's generated ids, timestamps included, EOS
    excluded (ctranslate2's `sequences_ids`)."""
    return [g.ids for g in generate(model, params, vocab, features_BTM, prompts,
                                    suppress_ids=suppress_ids,
                                    suppress_ids_begin=suppress_ids_begin,
                                    max_text_tokens=max_text_tokens, loop=loop)]


def transcribe_ids(model, params, vocab, model_dir, features_BTM, *, max_new_tokens: int = 224,
                   language: Optional[str] = "en", task: str = "transcribe",
                   timestamps: bool = False, loop: str = "while") -> list[list[int]]:
    """Greedy transcription as Whisper decodes: forced prompt (`prompt_ids`), suppressed
    tokens, blank/EOS suppressed at the first free step, and the timestamp rules
    with `timestamps`. Returns each row's token ids (prompt and EOS excluded, as
    ctranslate2's `sequences_ids`; with timestamps, they are among them).

    `max_new_tokens` counts the whole decoder input after BOS, as ctranslate2's
    `max_length` does (so the prompt is part of it). `loop="while"` (default)
    stops once every row emitted EOS, as ctranslate2 does; "scan" always runs
    `max_new_tokens - 1` steps. Both give the same ids.
    """
    special = special_ids(model_dir)
    prompt = prompt_ids(vocab, language, task, timestamps)
    return generate_ids(model, params, vocab, features_BTM, [prompt] * features_BTM.shape[0],
                        suppress_ids=special["suppress_ids"],
                        suppress_ids_begin=special["suppress_ids_begin"],
                        max_text_tokens=max_new_tokens - len(prompt), loop=loop)

"""OpenAI Whisper on jaxformer's blocks: config, the CTranslate2 weight mapping, and
Whisper's decoding conventions (prompts, token suppression, timestamp rules,
language detection).

Whisper is a Pre-LN encoder-decoder Transformer: the encoder reads a log-mel
spectrogram (80 bins, 3000 frames) through two 1-D convolutions (width 3,
strides 1 and 2, GELU: `stems.ConvStem`) and adds a fixed sinusoidal table
(1500 rows); the decoder has a learned table (448 rows) and a tied output.
Attention has query, value and out biases but no key bias. Everything here is
a choice of `TransformerConfig` fields and a renaming of the file's tensors;
no layer is Whisper-specific.

    model, params, vocab = load_ct2(model_dir)       # CTranslate2 model.bin folder
    ids = transcribe_ids(model, params, vocab, model_dir, features_BTM, timestamps=True)
    [(code, p)] = detect_language(model, params, vocab, features_BTM[:1])

Audio files to text (windows, segments, SRT) are `jaxformer.models.transcribe`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.config import TransformerConfig
from jaxformer.errors import FileFormatError, require_file
from jaxformer.decode import cache as cache_lib, processors, sampling
from jaxformer.decode.cache import memory_cache
from jaxformer.decode.inputs import check_encdec, decodable
from jaxformer.decode.loop import (cached_logits_fn, decode_jit, decode_loop, init_state,
                                   segment_lengths, segments_for)
from jaxformer.decode.processors import NEG
from jaxformer.interop import ct2
from jaxformer.interop.flat import load_flat
from jaxformer.nn.model import Transformer
from jaxformer.nn.stems import ConvStem

N_MELS = 80
N_FRAMES = 3000  # 30 s at a 10 ms hop


def whisper_config(*, vocab_size: int, d_model: int, num_heads: int, d_ff: int, encoder_layers: int,
                   decoder_layers: int, encoder_len: int, decoder_len: int, pad_id: int,
                   bos_id: int, eos_id: int, dtype: str = "float32") -> TransformerConfig:
    """Whisper's `TransformerConfig` of the given sizes (both file formats build it)."""
    return TransformerConfig(
        src_vocab_size=vocab_size, tgt_vocab_size=vocab_size, d_model=d_model,
        num_heads=num_heads, d_ff=d_ff, num_encoder_layers=encoder_layers,
        num_decoder_layers=decoder_layers, max_len=decoder_len,
        encoder_max_len=encoder_len, decoder_max_len=decoder_len,
        norm="pre", activation="gelu", encoder_positions="fixed", decoder_positions="fixed",
        attention_biases="qvo", scale_embeddings=False, tie_output_embedding=True,
        encoder_input="embedded", pad_id=pad_id, eos_id=eos_id, bos_id=bos_id,
        dtype=dtype, param_dtype="float32")


def config_from_ct2(model: ct2.Ct2Model, vocab: list[str], dtype: str = "float32"
                    ) -> TransformerConfig:
    """The config a CTranslate2 WhisperSpec file describes."""
    v = model.variables
    if model.spec != "WhisperSpec":
        raise ValueError(f"not a Whisper file: spec {model.spec!r}")
    layers = {stack: len({n.split("/")[1] for n in v
                          if re.fullmatch(rf"{stack}/layer_\d+/.*", n)})
              for stack in ("encoder", "decoder")}
    ids = {token: i for i, token in enumerate(vocab)}
    eos = ids["<|endoftext|>"]
    return whisper_config(
        vocab_size=len(vocab), d_model=v["encoder/conv1/weight"].shape[0],
        num_heads=int(v["encoder/num_heads"]),
        d_ff=v["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        encoder_layers=layers["encoder"], decoder_layers=layers["decoder"],
        encoder_len=v["encoder/position_encodings/encodings"].shape[0],
        decoder_len=v["decoder/position_encodings/encodings"].shape[0],
        pad_id=eos, eos_id=eos, bos_id=ids["<|startoftranscript|>"], dtype=dtype)


def _norm(v, name):
    return {"scale": v[f"{name}/gamma"], "bias": v[f"{name}/beta"]}


def _linear(v, name):
    return v[f"{name}/weight"], v[f"{name}/bias"]


def map_ct2(model: ct2.Ct2Model, config: TransformerConfig) -> dict[str, np.ndarray]:
    """The file's tensors in jaxformer's flat names and layouts (float16 kept).

    torch layouts: Linear weight (out, in), Conv1d weight (out, in, width). The
    fused projections are split: self-attention linear_0 = [q; k; v], cross
    attention linear_1 = [k; v]. The key bias (zeros in these files, and
    without effect anyway: it shifts every logit of a query equally) is dropped.
    """
    v = model.variables
    D, H, K = config.d_model, config.num_heads, config.head_dim
    flat = {}

    def put(prefix, tree):
        for key, value in tree.items():
            flat[f"{prefix}/{key}"] = value

    def heads(w, b, part):
        out = {"kernel": w.T.reshape(D, H, K)}
        if part != "key":
            out["bias"] = b.reshape(H, K)
        return out

    def attention(prefix, name, fused_qkv: bool):
        if fused_qkv:
            w, b = _linear(v, f"{name}/linear_0")
            parts = {p: (w[i * D:(i + 1) * D], b[i * D:(i + 1) * D])
                     for i, p in enumerate(("query", "key", "value"))}
            out_w, out_b = _linear(v, f"{name}/linear_1")
        else:
            parts = {"query": _linear(v, f"{name}/linear_0")}
            w, b = _linear(v, f"{name}/linear_1")
            parts.update(key=(w[:D], b[:D]), value=(w[D:], b[D:]))
            out_w, out_b = _linear(v, f"{name}/linear_2")
        for part, (w, b) in parts.items():
            for key, value in heads(w, b, part).items():
                flat[f"{prefix}/{part}/{key}"] = value
        put(f"{prefix}/out", {"kernel": out_w.T.reshape(H, K, D), "bias": out_b})

    def ffn(prefix, name):
        for ours, theirs in (("wi", "linear_0"), ("wo", "linear_1")):
            w, b = _linear(v, f"{name}/{theirs}")
            put(f"{prefix}/{ours}", {"kernel": w.T, "bias": b})

    for i, stride in enumerate((1, 2)):
        w, b = _linear(v, f"encoder/conv{i + 1}")
        put(f"stem/conv_{i}", {"kernel": w.transpose(2, 1, 0), "bias": b})
    flat["encoder/positions/embedding"] = v["encoder/position_encodings/encodings"]
    for i in range(config.num_encoder_layers):
        ours, theirs = f"encoder/layers_{i}", f"encoder/layer_{i}"
        attention(f"{ours}/self_attn", f"{theirs}/self_attention", True)
        put(f"{ours}/self_attn_norm", _norm(v, f"{theirs}/self_attention/layer_norm"))
        ffn(f"{ours}/ffn", f"{theirs}/ffn")
        put(f"{ours}/ffn_norm", _norm(v, f"{theirs}/ffn/layer_norm"))
    put("encoder/final_norm", _norm(v, "encoder/layer_norm"))
    flat["tgt_embed/embedding"] = v["decoder/embeddings/weight"]
    flat["decoder/positions/embedding"] = v["decoder/position_encodings/encodings"]
    for i in range(config.num_decoder_layers):
        ours, theirs = f"decoder/layers_{i}", f"decoder/layer_{i}"
        attention(f"{ours}/self_attn", f"{theirs}/self_attention", True)
        put(f"{ours}/self_attn_norm", _norm(v, f"{theirs}/self_attention/layer_norm"))
        attention(f"{ours}/cross_attn", f"{theirs}/attention", False)
        put(f"{ours}/cross_attn_norm", _norm(v, f"{theirs}/attention/layer_norm"))
        ffn(f"{ours}/ffn", f"{theirs}/ffn")
        put(f"{ours}/ffn_norm", _norm(v, f"{theirs}/ffn/layer_norm"))
    put("decoder/final_norm", _norm(v, "decoder/layer_norm"))
    return flat


def load_ct2(model_dir: str, dtype: str = "float32"):
    """(model, params, vocabulary) from a CTranslate2 Whisper folder
    (`model.bin`, `vocabulary.txt`); float16 weights are cast to float32."""
    vocab_path = require_file(os.path.join(model_dir, "vocabulary.txt"), "vocabulary file")
    with open(vocab_path, encoding="utf-8") as f:
        vocab = f.read().rstrip("\n").split("\n")
    missing = [t for t in ("<|endoftext|>", "<|startoftranscript|>", "<|transcribe|>",
                           "<|notimestamps|>") if t not in vocab]
    if missing:
        raise FileFormatError(vocab_path, f"{len(vocab)} tokens without {', '.join(missing)}",
                              "it is cut short or not a Whisper vocabulary")
    file = ct2.read_ct2(os.path.join(model_dir, "model.bin"))
    for flag, want in (("decoder/scale_embeddings", 0), ("decoder/pre_norm", 1)):
        if flag in file.variables and int(file.variables[flag]) != want:
            raise ValueError(f"{model_dir}: {flag}={int(file.variables[flag])}, this mapping "
                             f"expects {want}")
    config = config_from_ct2(file, vocab, dtype)
    model = Transformer(config, stem=ConvStem(config))
    features = jax.ShapeDtypeStruct((1, 2 * config.encoder_len, N_MELS), jnp.float32)
    params = load_flat(model, map_ct2(file, config), features,
                       jax.ShapeDtypeStruct((1, 1), jnp.int32))
    return model, params, vocab


def special_ids(model_dir: str) -> dict:
    """suppress_ids and suppress_ids_begin of the folder's config.json."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        return json.load(f)


# -- token conventions ------------------------------------------------------------------

TASKS = ("transcribe", "translate")
# Every language code a Whisper vocabulary can hold (openai-whisper's LANGUAGES, in
# vocabulary order; large-v3 added "yue"): a code outside it is refused before any
# model is read. Which of them a given model knows is its vocabulary's business.
LANGUAGE_CODES = (
    "en", "zh", "de", "es", "ru", "ko", "fr", "ja", "pt", "tr", "pl", "ca", "nl", "ar", "sv",
    "it", "id", "hi", "fi", "vi", "he", "uk", "el", "ms", "cs", "ro", "da", "hu", "ta", "no",
    "th", "ur", "hr", "bg", "lt", "la", "mi", "ml", "cy", "sk", "te", "fa", "lv", "bn", "sr",
    "az", "sl", "kn", "et", "mk", "br", "eu", "is", "hy", "ne", "mn", "bs", "kk", "sq", "sw",
    "gl", "mr", "pa", "si", "km", "sn", "yo", "so", "af", "oc", "ka", "be", "tg", "sd", "gu",
    "am", "yi", "lo", "uz", "fo", "ht", "ps", "tk", "nn", "mt", "sa", "lb", "my", "bo", "tl",
    "mg", "as", "tt", "haw", "ln", "ha", "ba", "jw", "su", "yue")


def check_language_code(code: str) -> None:
    """ValueError unless `code` is "auto" or a Whisper language code (`LANGUAGE_CODES`)."""
    if code != "auto" and code not in LANGUAGE_CODES:
        raise ValueError(f"unknown language {code!r}: Whisper's codes are ISO 639-1 style, "
                         f"e.g. {', '.join(LANGUAGE_CODES[:8])} (or 'auto')")
TIME_PRECISION = 0.02  # seconds per timestamp token: <|0.00|>, <|0.02|>, ...
MULTILINGUAL_VOCAB = 51865  # openai-whisper's test: English-only (".en") vocabularies are smaller


@dataclasses.dataclass(frozen=True)
class Tokens:
    """The special token ids of a Whisper vocabulary (text tokens come first, then
    <|endoftext|>, <|startoftranscript|>, the language tokens, the task tokens,
    ..., <|notimestamps|>, and the timestamps <|0.00|> .. <|30.00|> last)."""

    eot: int
    sot: int
    translate: int
    transcribe: int
    no_timestamps: int
    timestamp_begin: int
    languages: tuple[str, ...]  # codes, in vocabulary order
    language_ids: tuple[int, ...]
    multilingual: bool
    no_speech: Optional[int] = None  # <|nospeech|> (<|nocaptions|> in older vocabularies)

    def language_id(self, code: str) -> int:
        """The id of <|code|>, or ValueError naming the code and listing known ones."""
        if code not in self.languages:
            raise ValueError(f"unknown language {code!r}: the model knows {len(self.languages)} "
                             f"codes, e.g. {', '.join(self.languages[:8])} (or 'auto')")
        return self.language_ids[self.languages.index(code)]


def tokens_of(vocab: list[str]) -> Tokens:
    """The `Tokens` of a vocabulary (as `load_ct2` returns it)."""
    ids = {token: i for i, token in enumerate(vocab)}
    sot, translate = ids["<|startoftranscript|>"], ids["<|translate|>"]
    languages = [(vocab[i][2:-2], i) for i in range(sot + 1, translate)
                 if re.fullmatch(r"<\|[a-z]{2,3}(-[a-z]+)?\|>", vocab[i])]
    no_timestamps = ids["<|notimestamps|>"]
    return Tokens(eot=ids["<|endoftext|>"], sot=sot, translate=translate,
                  transcribe=ids["<|transcribe|>"], no_timestamps=no_timestamps,
                  timestamp_begin=no_timestamps + 1,
                  languages=tuple(c for c, _ in languages),
                  language_ids=tuple(i for _, i in languages),
                  multilingual=len(vocab) >= MULTILINGUAL_VOCAB,
                  no_speech=ids.get("<|nospeech|>", ids.get("<|nocaptions|>")))


def prompt_ids(vocab: list[str], language: Optional[str] = "en", task: str = "transcribe",
               timestamps: bool = False) -> list[int]:
    """The decoder prompt: <|startoftranscript|> <|language|> <|task|>, then
    <|notimestamps|> unless `timestamps`. `language=None` leaves out the language and
    task tokens, the form English-only models were trained with.

    Raises:
      ValueError naming an unknown language code or task.
    """
    t = tokens_of(vocab)
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    ids = [t.sot]
    if language is not None:
        ids += [t.language_id(language), t.translate if task == "translate" else t.transcribe]
    return ids if timestamps else ids + [t.no_timestamps]


# -- decoding ---------------------------------------------------------------------------


def encode(model, params, features_BTM):
    """The encoder output (B, 1500, D) of log-mel features (B, 3000, 80), jitted and
    compiled as transcription compiles it (`decode.loop.decode_jit`)."""
    return _encode_jit(model, params, features_BTM)


def _encode(model, params, features_BTM):
    return model.apply({"params": params}, features_BTM, method=Transformer.encode)


_encode_jit = decode_jit(static_argnames=("model",))(_encode)


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
class TimestampRules:
    """Whisper's timestamp rules as a logits processor (ctranslate2's
    `ApplyTimestampRules`), for prompts without <|notimestamps|>.

    From step `sample_begin` (the first token after the prompt) on:
    <|notimestamps|> is never picked; the first token is a timestamp of at most
    `max_initial` (index into the timestamps: 50 = 1.00 s); timestamps come in
    pairs (after a pair the next token is text or EOS, after a single timestamp
    it is a timestamp or EOS) and never decrease; and where the timestamps
    together are more probable than any single text token, a timestamp is
    picked. Rows are handled independently; the other processors (token
    suppression) must run before this one, as in ctranslate2.
    """

    eot_id: int
    no_timestamps_id: int
    timestamp_begin: int
    sample_begin: int
    max_initial: int = 50

    def check(self, vocab_size: int) -> None:
        if not 0 <= self.eot_id < self.no_timestamps_id < self.timestamp_begin < vocab_size:
            raise ValueError(f"TimestampRules: ids eot {self.eot_id} < no_timestamps "
                             f"{self.no_timestamps_id} < timestamp_begin "
                             f"{self.timestamp_begin} < vocab_size {vocab_size} expected")

    def __call__(self, logits_BV, step, tokens_BN):
        processors.check_inputs("TimestampRules", logits_BV, step, tokens_BN)
        ids_V = jnp.arange(logits_BV.shape[-1])
        is_time_V = ids_V >= self.timestamp_begin
        col_N = jnp.arange(tokens_BN.shape[1])
        last_B = jnp.take(tokens_BN, jnp.maximum(step - 1, 0), axis=1)
        before_B = jnp.where(step - 1 > self.sample_begin,
                             jnp.take(tokens_BN, jnp.maximum(step - 2, 0), axis=1), last_B)
        first, after = step == self.sample_begin, step > self.sample_begin
        last_time_B = after & (last_B >= self.timestamp_begin)
        pair_B = last_time_B & (before_B >= self.timestamp_begin)
        # The latest timestamp generated so far: later ones may not be smaller.
        seen_BN = ((col_N >= self.sample_begin) & (col_N < step))[None] & (
            tokens_BN >= self.timestamp_begin)
        latest_B = jnp.take_along_axis(
            tokens_BN, jnp.argmax(jnp.where(seen_BN, col_N, -1), axis=1)[:, None], axis=1)[:, 0]
        ban_BV = jnp.broadcast_to(ids_V == self.no_timestamps_id, logits_BV.shape)
        ban_BV |= first & (~is_time_V | (ids_V > self.timestamp_begin + self.max_initial))
        ban_BV |= pair_B[:, None] & is_time_V
        ban_BV |= (last_time_B & ~pair_B)[:, None] & (ids_V < self.eot_id)
        ban_BV |= (after & seen_BN.any(axis=1))[:, None] & is_time_V & (
            ids_V < latest_B[:, None])
        logits_BV = jnp.where(ban_BV, NEG, logits_BV)
        # Timestamps as a whole more probable than the best text token: take one.
        logp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
        time_B = jax.nn.logsumexp(jnp.where(is_time_V, logp_BV, -jnp.inf), axis=-1)
        text_B = jnp.max(jnp.where(is_time_V, -jnp.inf, logp_BV), axis=-1)
        force_B = after & ~pair_B & (time_B > text_B)
        return jnp.where(force_B[:, None] & ~is_time_V, NEG, logits_BV)


def whisper_processors(vocab: list[str], prompt: list[int], suppress_ids, suppress_ids_begin,
                       *, max_initial_timestamp_index: int = 50) -> tuple:
    """The logits processors Whisper decodes with after `prompt`: `suppress_ids` at
    every step, `suppress_ids_begin` (blank, EOS) at the first step after the
    prompt, and the `TimestampRules` unless the prompt ends with <|notimestamps|>."""
    t = tokens_of(vocab)
    begin = len(prompt) - 1  # the prompt after BOS is forced: steps 0 .. begin - 1
    out = (processors.suppress_tokens(suppress_ids),
           processors.suppress_at_step(suppress_ids_begin, at=begin))
    if prompt[-1] != t.no_timestamps:
        out += (TimestampRules(t.eot, t.no_timestamps, t.timestamp_begin, begin,
                               int(max_initial_timestamp_index)),)
    return out


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
                             "segments"))
def _generate_program(model, params, features_BTM, prefix_BP, *, max_new_tokens, processors,
                      no_speech_id, loop, segments):
    """Greedy decode that also records the no-speech probability of step 0 and the
    summed log-probabilities: (tokens (B, N), lengths (B,), logprob (B,), no_speech (B,))."""
    c = model.config
    batch = features_BTM.shape[0]
    cache = memory_cache(model, params, features_BTM, None,
                         segment_lengths(max_new_tokens, segments)[0])
    prefix_len_B = (None if prefix_BP is None
                    else jnp.full((batch,), prefix_BP.shape[1], jnp.int32))
    state = init_state(jnp.full((batch,), c.bos_id, jnp.int32),
                       (cache, jnp.zeros((batch,), jnp.float32)), max_new_tokens,
                       pad_id=c.pad_id, prefix_BP=prefix_BP, prefix_len_B=prefix_len_B,
                       scores=True)
    step_fn = cached_logits_fn(model, params)

    def logits_fn(token_B, carry, step):
        logits_BV, cache = step_fn(token_B, carry[0], step)
        logits_BV32 = logits_BV.astype(jnp.float32)
        p_B = jnp.exp(logits_BV32[:, no_speech_id] - jax.nn.logsumexp(logits_BV32, axis=-1))
        return logits_BV, (cache, jnp.where(step == 0, p_B, carry[1]))

    state = decode_loop(logits_fn, state, max_new_tokens, select=sampling.greedy,
                        eos_id=c.eos_id, pad_id=c.pad_id, loop=loop, processors=processors,
                        segments=segments,
                        fold=lambda carry, n: (cache_lib.fold(carry[0], n), carry[1]))
    return state.tokens_BN, state.lengths_B, state.logprob_B, state.cache[1]


def generate(model, params, vocab: list[str], features_BTM, prompts: list[list[int]], *,
             suppress_ids, suppress_ids_begin, max_text_tokens: int = 224,
             loop: str = "while") -> list[Generated]:
    """Greedy decoding of each row after its prompt (all prompts of one length, each
    starting with <|startoftranscript|>), with `whisper_processors`, in one compiled
    program: each row's `Generated` ids, no-speech probability and average
    log-probability (what Whisper's no-speech rule reads). At most
    `max_text_tokens` are generated."""
    width = {len(p) for p in prompts}
    if len(width) != 1 or len(prompts) != features_BTM.shape[0]:
        raise ValueError(f"prompts: one per row of the features ({features_BTM.shape[0]}), "
                         f"all of one length; got lengths {sorted(width)}")
    width, t = width.pop(), tokens_of(vocab)
    if len({p[-1] == t.no_timestamps for p in prompts}) > 1 or any(p[0] != t.sot
                                                                    for p in prompts):
        raise ValueError("prompts: each starts with <|startoftranscript|>, and all end with "
                         "<|notimestamps|> or none does")
    max_new_tokens = width - 1 + int(max_text_tokens)
    procs, prefix_BP, _ = check_encdec(
        model, features_BTM, None, max_new_tokens=max_new_tokens, loop=loop,
        processors=whisper_processors(vocab, prompts[0], suppress_ids, suppress_ids_begin),
        prefix=np.asarray([p[1:] for p in prompts], np.int32) if width > 1 else None)
    no_speech = t.no_speech if t.no_speech is not None else t.eot
    tokens, lengths, logprob, no_speech_p = (np.asarray(x) for x in _generate_program(
        *decodable(model, params), jnp.asarray(features_BTM), prefix_BP,
        max_new_tokens=max_new_tokens, processors=procs, no_speech_id=no_speech, loop=loop,
        segments=segments_for(max_new_tokens)))
    eos = model.config.eos_id
    rows = []
    for row, length, total, p in zip(tokens, lengths, logprob, no_speech_p):
        text = row[width - 1:int(length)].tolist()
        ids = text[:-1] if text and text[-1] == eos else text
        rows.append(Generated(ids, None if t.no_speech is None else float(p),
                              float(total) / (len(ids) + 1)))
    return rows


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

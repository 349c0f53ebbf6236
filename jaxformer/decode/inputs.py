"""Host-side checks and preparation of the decoding entry points' inputs.

Every decoding entry point (`decoding.greedy_decode`, `sample`,
`greedy_decode_recompute`, `generate`, `beam.beam_search`) runs these before
anything is traced, so a bad argument raises a TypeError or ValueError naming
it, and nothing is compiled:

  decodable(model, params)        params unwrapped; a scanned model unrolled
  check_encdec(model, src_BS, ...)  encoder-decoder sources, masks, lengths,
                                  loop, processors and forced prefix, at once
  check_prefix(prefix, lengths, ...)  a forced decoder prefix (ragged rows)
  check_prompt(prompt_BP, ...)    right-padded decoder-only prompts
  check_max_new_tokens, check_loop, check_rng

and `left_align`, the traced shift of right-padded prompts to left padding
(`decoding.generate`).
"""

from __future__ import annotations

import flax
import jax.numpy as jnp
import numpy as np

from jaxformer.nn import checks, stacking
from jaxformer.decode import processors as processors_lib
from jaxformer.decode.loop import check_loop
from jaxformer.nn.model import Transformer


def decodable(model, params):
    """(model, params) for a decode entry point: `{"params": p}` (what `init` returns)
    unwrapped to `p`, its layer layout checked against the model's (the compiled
    program unrolls a scanned model, `stacking.for_decoding`) and its values
    finite (`checks.check_finite_params`)."""
    if isinstance(params, (dict, flax.core.FrozenDict)) and set(params.keys()) == {"params"}:
        params = params["params"]
    stacking.check_layout(params, model.config.scan_layers)
    checks.check_finite_params(params)
    return model, params


def check_rng(rng) -> None:
    if rng is None or not hasattr(rng, "shape"):
        raise TypeError(f"rng must be a jax.random key, got {rng!r}")


def check_max_new_tokens(max_new_tokens, limit: int, what: str) -> None:
    """An int in 1..limit; `what` says why the limit (in the message)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
        raise TypeError(f"max_new_tokens must be an int, got {type(max_new_tokens).__name__}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if max_new_tokens > limit:
        raise ValueError(f"max_new_tokens={max_new_tokens} is too long: {what}")


def check_prefill_chunk(prefill_chunk) -> None:
    """None, or an int >= 1 (prompt tokens per prefill call)."""
    if prefill_chunk is None:
        return
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, (int, np.integer)):
        raise TypeError(f"prefill_chunk must be an int or None, got "
                        f"{type(prefill_chunk).__name__}")
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")


def check_prefix(prefix_BP, prefix_lengths, *, batch: int, vocab_size: int,
                 max_new_tokens: int, max_len: int):
    """Host check of a forced decoder prefix -> (prefix (B, P) int32, lengths (B,) int32),
    or (None, None) when `prefix_BP` is None.

    A prefix is the first tokens after BOS, forced row by row; rows may be
    ragged (`prefix_lengths`, default: P for every row; values past a row's
    length are ignored). The forced tokens are part of the output and count
    towards `max_new_tokens`.
    """
    if prefix_BP is None:
        if prefix_lengths is not None:
            raise ValueError("prefix_lengths given without a prefix")
        return None, None
    prefix = np.asarray(prefix_BP)
    if prefix.ndim == 1:
        prefix = np.broadcast_to(prefix[None], (batch, prefix.shape[0]))
    if prefix.ndim != 2 or prefix.shape[0] != batch or prefix.shape[1] < 1:
        raise ValueError(f"prefix must be (P,) or ({batch}, P) token ids with P >= 1, got "
                         f"shape {prefix.shape}")
    if not np.issubdtype(prefix.dtype, np.integer):
        raise ValueError(f"prefix must hold integer token ids, got {prefix.dtype}")
    width = prefix.shape[1]
    lengths = (np.full((batch,), width) if prefix_lengths is None
               else np.asarray(prefix_lengths))
    if lengths.shape != (batch,) or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"prefix_lengths must be ({batch},) ints, got {lengths.dtype} "
                         f"{lengths.shape}")
    if np.any(lengths < 0) or np.any(lengths > width):
        raise ValueError(f"prefix_lengths must be in 0..{width}, got {lengths.tolist()}")
    used = np.arange(width)[None, :] < lengths[:, None]
    bad = prefix[used & ((prefix < 0) | (prefix >= vocab_size))]
    if bad.size:
        raise ValueError(f"prefix has token id(s) {sorted(set(bad.tolist()))} outside the "
                         f"target vocabulary 0..{vocab_size - 1}")
    longest = int(lengths.max())
    if longest >= max_len:
        raise ValueError(f"prefix of {longest} tokens is too long: BOS + prefix needs "
                         f"{longest + 1} decoder positions, the decoder has {max_len} "
                         f"(config.decoder_max_len or max_len)")
    if longest > max_new_tokens:
        raise ValueError(f"prefix of {longest} tokens is longer than max_new_tokens="
                         f"{max_new_tokens} (forced tokens count towards it)")
    return jnp.asarray(prefix, jnp.int32), jnp.asarray(lengths, jnp.int32)


def _check_source(model, src, src_mask) -> None:
    """The source of an encoder-decoder: ids, embeddings or the stem's input, and its mask."""
    if not isinstance(model, Transformer):
        raise TypeError(f"model must be a jaxformer Transformer (encoder-decoder), got "
                        f"{type(model).__name__}; use generate() for a DecoderOnlyLM")
    c = model.config
    if not hasattr(src, "ndim") or src.ndim not in (2, 3):
        raise ValueError("src_BS must be (batch, length) token ids or (batch, length, d_model) "
                         f"embeddings, got shape {getattr(src, 'shape', None)}")
    if model.stem is not None:  # the stem's input: its own channels and length
        if src.ndim != 3:
            raise ValueError(f"src_BS must be (batch, length, channels) for the model's stem, "
                             f"got shape {src.shape}")
    elif src.ndim == 3:
        checks.check_embedded("src_BS", src, c.d_model, c.encoder_len)
    elif c.encoder_input != "tokens":
        raise ValueError('src_BS: this encoder reads embedded inputs (config.encoder_input='
                         f'"embedded"), got token ids of shape {src.shape}')
    else:
        checks.check_tokens("src_BS", src, c.src_vocab_size, c.encoder_len)
    if src.shape[0] < 1 or src.shape[1] < 1:
        raise ValueError(f"src_BS must be non-empty, got shape {src.shape}")
    if src_mask is not None:
        checks.check_mask("src_mask", src_mask, src.shape[0], 1, src.shape[1])
        if model.stem is None and src_mask.shape[3] != src.shape[1]:
            raise ValueError(f"src_mask has key size {src_mask.shape[3]}, expected "
                             f"{src.shape[1]} (the source length)")


def check_encdec(model, src_BS, src_mask, *, max_new_tokens, loop: str = "scan",
                 processors=None, prefix=None, prefix_lengths=None):
    """All host checks of an encoder-decoder decode call, in argument order.

    Returns:
      (processors as a checked tuple, prefix (B, P) int32 or None, prefix
      lengths (B,) int32 or None): what the jitted cores take.
    """
    _check_source(model, src_BS, src_mask)
    c = model.config
    # The decoder feeds BOS and the first N-1 picks at positions 0..N-1.
    check_max_new_tokens(max_new_tokens, c.decoder_len,
                         f"decoder positions 0..{max_new_tokens - 1} must stay below "
                         f"the decoder's max_len={c.decoder_len}")
    check_loop(loop)
    procs = processors_lib.normalize(processors, c.tgt_vocab_size)
    prefix_BP, prefix_len_B = check_prefix(
        prefix, prefix_lengths, batch=src_BS.shape[0], vocab_size=c.tgt_vocab_size,
        max_new_tokens=int(max_new_tokens), max_len=c.decoder_len)
    return procs, prefix_BP, prefix_len_B


def check_prompt(prompt_BP, prompt_lengths, *, vocab_size: int, pad_id: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded decoder-only prompts -> (prompt (B, P), lengths (B,)) as numpy.

    `prompt_lengths` (B,) ints in 1..P; default: the number of non-PAD ids
    (PAD must then only trail).
    """
    checks.check_tokens("prompt_BP", prompt_BP, vocab_size)
    prompt = np.asarray(prompt_BP)
    batch, width = prompt.shape
    if batch < 1 or width < 1:
        raise ValueError(f"prompt_BP must be non-empty, got shape {prompt.shape}")
    if prompt_lengths is None:
        lengths = (prompt != pad_id).sum(axis=1)
        trailing = np.arange(width)[None, :] >= lengths[:, None]
        if np.any((prompt == pad_id) != trailing):
            raise ValueError("prompt_BP has PAD ids inside a prompt: pass prompt_lengths "
                             "explicitly (prompts are right-padded)")
    else:
        lengths = np.asarray(prompt_lengths)
        if lengths.shape != (batch,) or not np.issubdtype(lengths.dtype, np.integer):
            raise ValueError(f"prompt_lengths must be ({batch},) ints, got "
                             f"{lengths.dtype} {lengths.shape}")
    if np.any(lengths < 1) or np.any(lengths > width):
        raise ValueError(f"prompt_lengths must be in 1..{width} (every row needs a prompt "
                         f"token), got {lengths.tolist()}")
    return prompt, lengths


def check_lm_prompt(config, prompt_BP, prompt_lengths, max_new_tokens
                    ) -> tuple[np.ndarray, np.ndarray]:
    """`check_prompt` for a decoder-only LM continued by `max_new_tokens`, which its
    positions must hold (prompt width + N - 1 <= config.decoder_len)."""
    prompt, lengths = check_prompt(prompt_BP, prompt_lengths, vocab_size=config.tgt_vocab_size,
                                   pad_id=config.pad_id)
    width = prompt.shape[1]
    check_max_new_tokens(max_new_tokens, config.decoder_len - width + 1,
                         f"prompt width {width} + {max_new_tokens} new tokens - 1 exceeds "
                         f"the decoder's max_len={config.decoder_len}")
    return prompt, lengths


def left_align(prompt_BP: jnp.ndarray, lengths_B: jnp.ndarray, pad_id: int) -> jnp.ndarray:
    """Right-padded prompts (B, P) -> left-padded: row b shifted right by P - lengths_B[b]."""
    width = prompt_BP.shape[1]
    shift_B1 = (width - lengths_B)[:, None]
    source_BP = jnp.arange(width)[None, :] - shift_B1
    shifted_BP = jnp.take_along_axis(prompt_BP, jnp.clip(source_BP, 0, width - 1), axis=1)
    return jnp.where(source_BP >= 0, shifted_BP, pad_id)

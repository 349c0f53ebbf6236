"""The engine's speculative decode step: k prompt-lookup drafts per slot, one pass.

With `Engine(..., speculative=k)`, each decode step feeds every decoding slot its
pending token and up to k drafts (T = k + 1 tokens per row, `paged.paged_forward`),
then keeps, per row, the drafts the target agrees with and one token of its own:

  greedy rows (temperature 0): the longest prefix of drafts equal to the argmax of
    the raw logits, then the argmax at the first disagreement: plain greedy tokens;
  sampled rows: draft i is accepted with probability p_i(d_i) (the row's temperature
    / top-k / top-p distribution; a prompt-lookup draft is deterministic, q = one-hot),
    at the first rejection a token is drawn from p_i with d_i removed (norm(max(0,
    p - q))), after every draft the plain draw at that position: distributed as plain
    sampling (`speculative.rejection_verify`, tested statistically there). Keys are
    `fold_in(PRNGKey(seed), position)` as in `select.pick`, folded again with 1 (the
    acceptance test) or 2 (the residual draw): a request's tokens still depend on its
    own seed only.

Rows with a structured-output constraint draft nothing (their mask is for the next
position only). Rejected drafts' keys stay in the row's pages beyond its length: unread
(a view gathers positions < length) and overwritten by the next tokens fed.
"""

from __future__ import annotations

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.backends import cpu
from jaxformer.serve import batching, paged, select
from jaxformer.serve.speculative import NGRAM

__all__ = ["Verified", "draft_tokens", "verify_program", "compiled_verify", "speculative_step"]

COMPILED: dict = {}


def draft_tokens(tokens: Sequence[int], k: int, n_min: int = NGRAM[0],
                 n_max: int = NGRAM[1]) -> list[int]:
    """Prompt lookup on the host: what followed the most recent earlier occurrence of
    the sequence's last n tokens (the longest n in n_min..n_max that occurs), at most k
    ids; [] if none. The same rule as `speculative.ngram_draft` (tested equal)."""
    seq = np.asarray(tokens, np.int64)
    length = seq.shape[0]
    for n in range(n_max, n_min - 1, -1):
        if length < n + 1:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(seq[:length - 1], n)
        hits = np.flatnonzero((windows == seq[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return seq[start:start + k].tolist()
    return []


@flax.struct.dataclass
class Verified:
    """Per row: tokens (S, T) whose first `emitted` (S,) are the output, their logprobs
    (S, T) and the (S, T, MAX_LOGPROBS) best ids and logprobs at each position."""
    tokens: jax.Array
    emitted: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def verify_program(model, page_size, params, pools, table_SM, lengths_S, tokens_ST, valid_ST,
                   counts_S, slot_params, want_top, allowed_SV, *, view_len: int,
                   masked: bool):
    """Feed [pending, drafts] per row; accept as the module docstring says (`want_top`:
    () bool, some row asked for top-n logprobs, as `select.pick`)."""
    logits_STV, pools = paged.paged_forward(model, params, pools, table_SM, lengths_S,
                                            tokens_ST, valid_ST, page_size=page_size,
                                            view_len=view_len)
    logits_STV = logits_STV.astype(jnp.float32)
    rows, width, vocab = logits_STV.shape
    if masked:  # constrained rows: the first position only (they draft nothing)
        logits_STV = logits_STV.at[:, 0].set(jnp.where(allowed_SV, logits_STV[:, 0],
                                                       select.NEG))
    flat = jax.tree_util.tree_map(lambda x: jnp.repeat(x, width), slot_params)
    positions_ST = lengths_S[:, None] + 1 + jnp.arange(width)[None, :]
    logits_NV = logits_STV.reshape(rows * width, vocab)
    picks = select.pick(logits_NV, flat, positions_ST.reshape(-1), want_top)
    pick_ST = picks.token.reshape(rows, width)
    draft_SK = tokens_ST[:, 1:]
    greedy_S = slot_params.temperature <= 0
    drafted_SK = jnp.arange(width - 1)[None, :] < counts_S[:, None]

    def accepted(ok_SK):  # (S,) the length of each row's accepted run of drafts
        return jnp.sum(jnp.cumprod((ok_SK & drafted_SK).astype(jnp.int32), axis=1), axis=1)

    def plain_at(accepted_S):  # the row's plain pick at the position after its drafts
        return jnp.take_along_axis(pick_ST, accepted_S[:, None], axis=1)[:, 0]

    def all_greedy(_):
        accepted_S = accepted(draft_SK == pick_ST[:, :-1])
        return accepted_S, plain_at(accepted_S)

    def some_sampled(_):
        filtered_NV = select.scaled_filtered_logits(logits_NV, flat)
        probs_STV = jax.nn.softmax(filtered_NV, axis=-1).reshape(rows, width, vocab)
        keys_ST = jax.vmap(jax.vmap(lambda s, p: jax.random.fold_in(jax.random.PRNGKey(s), p),
                                    (None, 0)))(slot_params.seed.astype(jnp.uint32),
                                                positions_ST)
        u_SK = jax.vmap(jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1))))(
            keys_ST[:, :-1])
        p_draft_SK = jnp.take_along_axis(probs_STV[:, :-1], draft_SK[..., None],
                                         axis=-1)[..., 0]
        accepted_S = accepted(jnp.where(greedy_S[:, None], draft_SK == pick_ST[:, :-1],
                                        u_SK < p_draft_SK))
        # After a rejected draft d_n, a draw from the row's distribution without d_n.
        at = accepted_S[:, None]
        filtered_SV = jnp.take_along_axis(filtered_NV.reshape(rows, width, vocab),
                                          at[..., None], axis=1)[:, 0]
        rejected_S = jnp.take_along_axis(
            jnp.concatenate([draft_SK, jnp.zeros((rows, 1), draft_SK.dtype)], axis=1), at,
            1)[:, 0]
        residual_SV = jnp.where(jnp.arange(vocab)[None, :] == rejected_S[:, None],
                                select.NEG, filtered_SV)
        key_S = jax.vmap(lambda ks, n: jax.random.fold_in(ks[n], 2))(keys_ST, accepted_S)
        residual_draw_S = jax.vmap(jax.random.categorical)(key_S, residual_SV).astype(
            jnp.int32)
        resample_S = (~greedy_S) & (accepted_S < counts_S)
        return accepted_S, jnp.where(resample_S, residual_draw_S, plain_at(accepted_S))

    # An all-greedy step skips the sampled acceptance: its sort and softmax over the
    # vocabulary at every position cost several decode steps.
    accepted_S, final_S = jax.lax.cond(jnp.all(greedy_S), all_greedy, some_sampled, None)
    at = accepted_S[:, None]
    out_ST = jnp.where(jnp.arange(width)[None, :] < at,
                       jnp.concatenate([draft_SK, jnp.zeros((rows, 1), draft_SK.dtype)], 1),
                       final_S[:, None]).astype(jnp.int32)

    temperature_S = jnp.where(greedy_S, 1.0, slot_params.temperature)
    logp_STV = jax.nn.log_softmax(logits_STV / temperature_S[:, None, None], axis=-1)
    logprob_ST = jnp.take_along_axis(logp_STV, out_ST[..., None], axis=-1)[..., 0]
    top = picks.top_ids.shape[-1]
    return Verified(out_ST, (accepted_S + 1).astype(jnp.int32), logprob_ST,
                    picks.top_ids.reshape(rows, width, top),
                    picks.top_logprobs.reshape(rows, width, top)), pools


def compiled_verify():
    """`verify_program` jitted for the current backend (pools donated), once a process."""
    backend = jax.default_backend()
    key = (backend, cpu.process_tuned())
    if key not in COMPILED:
        COMPILED[key] = jax.jit(verify_program,
                                static_argnames=("model", "page_size", "view_len", "masked"),
                                donate_argnums=(3,),
                                compiler_options=cpu.decode_compiler_options(backend))
    return COMPILED[key]


def run_verify(engine, params, table, lengths, tokens, valid, counts, slot_params, want_top,
               allowed, view_len: int):
    """The compiled verify step (`verify_program`); the engine's pools updated."""
    with engine.compiling("verify", tokens.shape, view_len, allowed is None):
        out, engine.pools = compiled_verify()(
            engine.model, engine.page_size, params, engine.pools, table, lengths, tokens,
            valid, counts, slot_params, want_top,
            np.zeros((1, 1), bool) if allowed is None else allowed,
            view_len=view_len, masked=allowed is not None)
    return out


def warm_up(engine, view_len: int) -> None:
    """Run the verify step once with every row idle (`programs.warm_up`)."""
    slots, width = engine.slots, engine.speculative + 1
    jax.block_until_ready(run_verify(
        engine, engine.params[None], np.zeros((slots, engine.max_pages), np.int32),
        np.zeros((slots,), np.int32), np.zeros((slots, width), np.int32),
        np.zeros((slots, width), bool), np.zeros((slots,), np.int32),
        batching.slot_params([None] * slots), batching.want_top([]), None, view_len))


def speculative_step(engine, decoding) -> bool:
    """The engine's decode step with drafts (`Engine.decode_step` when `speculative`);
    False, having done nothing, when no slot has a draft (the plain decode step then
    runs: it feeds one position per row, not k + 1, for the same tokens)."""
    k = engine.speculative
    running = engine.running
    drafts = []
    for slot in decoding:
        params = slot.request.params
        room = min(params.max_tokens - slot.generated - 1, engine.max_len - slot.cached - 1)
        drafts.append([] if slot.request.constraint is not None or room <= 0 else (
            draft_tokens(slot.tokens, min(k, room), *engine.ngram)))
    if not any(drafts):
        return False
    counts = np.zeros((len(running),), np.int32)
    tokens = np.zeros((len(running), k + 1), np.int32)
    for slot, found in zip(decoding, drafts):
        i = running.index(slot)
        counts[i] = len(found)
        tokens[i, 0] = slot.pending
        tokens[i, 1:1 + len(found)] = found
        engine.take_pages(slot, slot.cached + 1 + len(found))
    lengths = np.asarray([0 if s is None else s.cached for s in running], np.int32)
    view_len = engine.decode_view(int(lengths.max()) + k + 1)
    table = batching.page_rows(running, engine.max_pages)
    allowed = batching.allowed([s if s in decoding else None for s in running],
                               engine.config.tgt_vocab_size)
    params = batching.slot_params(running)
    groups = {}
    for slot in decoding:
        groups.setdefault(slot.request.adapter, []).append(slot)
    results = []
    for adapter, members in groups.items():
        member = np.asarray([s in members for s in running])
        valid = member[:, None] & (np.arange(k + 1)[None, :] <= counts[:, None])
        out = run_verify(engine, engine.params[adapter], table, lengths, tokens, valid, counts,
                         params, batching.want_top(members), allowed, view_len)
        results.append((members, jax.device_get(out)))
    for members, out in results:
        for slot in members:
            i = running.index(slot)
            emitted = int(out.emitted[i])
            engine.count_drafts(int(counts[i]), emitted - 1)
            for j in range(emitted):
                slot.cached += 1
                slot.table.register_full(slot.tokens[:slot.cached])
                engine.accept(slot, out.tokens[i, j], out.logprob[i, j], out.top_ids[i, j],
                              out.top_logprobs[i, j])
                if running[i] is not slot:  # it finished (EOS, stop, length)
                    break
    return True

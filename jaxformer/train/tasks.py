"""Synthetic sequence-to-sequence tasks: copy, reverse, sort.

Token ids follow the config defaults: PAD 0, BOS 1, EOS 2; content tokens are
3..V-1. Each example draws its own length n in [min_len, max_len], so batches
mix lengths and the padding masks are exercised. With S = max_len and
T = max_len + 1::

    src     (B, S)  n content tokens, then PAD
    tgt_in  (B, T)  BOS + target, then PAD        (decoder input, teacher forcing)
    labels  (B, T)  target + EOS, then PAD        (PAD labels carry no loss)

target = src (copy), src reversed (reverse) or src sorted ascending (sort).
Defaults: vocabulary 32 (29 content tokens), lengths 1..10.

Held-out split. A source belongs to the held-out partition iff a fixed hash of
its (PAD-filled) token ids falls in bucket 0 of `HELDOUT_BUCKETS` (1 in 16).
The split is a property of the sequence, not of a random stream, so it holds
for every seed and step: `train_batch` never emits a held-out source, and
`heldout_set` emits only held-out sources. (Separate key streams would not be
enough: two streams can draw the same short sequence.) The hash is a fixed
FNV-1a + murmur3 finaliser in uint32, identical under jit and eagerly.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

TASKS = ("copy", "reverse", "sort")
HELDOUT_BUCKETS = 16
# How many candidates `train_batch` draws per row it needs; see its docstring.
_OVERSAMPLE = 4


class Batch(NamedTuple):
    """One batch of a seq2seq task (a pytree, so it can be sharded and jitted)."""

    src: jnp.ndarray     # (B, S) int32
    tgt_in: jnp.ndarray  # (B, T) int32, T = S + 1
    labels: jnp.ndarray  # (B, T) int32


@dataclasses.dataclass(frozen=True)
class Task:
    """A synthetic task. Build with `make_task`; all fields are validated there."""

    name: str = "copy"
    vocab_size: int = 32
    min_len: int = 1
    max_len: int = 10
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2

    @property
    def first_token(self) -> int:
        """Smallest content id: content tokens avoid PAD/BOS/EOS."""
        return max(self.pad_id, self.bos_id, self.eos_id) + 1

    @property
    def src_len(self) -> int:
        return self.max_len

    @property
    def tgt_len(self) -> int:
        return self.max_len + 1

    def targets(self, src_BS: jnp.ndarray, lengths_B: jnp.ndarray) -> jnp.ndarray:
        """(B, S) PAD-filled sources -> (B, S) PAD-filled targets of the task."""
        positions_BS = jnp.arange(self.max_len)[None, :]
        valid_BS = positions_BS < lengths_B[:, None]
        if self.name == "copy":
            return src_BS
        if self.name == "reverse":
            index_BS = jnp.where(valid_BS, lengths_B[:, None] - 1 - positions_BS, positions_BS)
            return jnp.take_along_axis(src_BS, index_BS, axis=1)
        # sort: PAD moved past every content token, sorted, then put back.
        big = jnp.iinfo(jnp.int32).max
        ordered_BS = jnp.sort(jnp.where(valid_BS, src_BS, big), axis=1)
        return jnp.where(valid_BS, ordered_BS, self.pad_id).astype(src_BS.dtype)

    @functools.partial(jax.jit, static_argnums=(0, 2))  # a Task is frozen, so hashable
    def sample(self, key: jax.Array, batch_size: int) -> Batch:
        """Draw `batch_size` examples from the task distribution (held-out ones included).

        Lengths are uniform in [min_len, max_len]; tokens uniform over content ids.
        """
        len_key, tok_key = jax.random.split(key)
        lengths_B = jax.random.randint(len_key, (batch_size,), self.min_len, self.max_len + 1)
        tokens_BS = jax.random.randint(tok_key, (batch_size, self.max_len), self.first_token,
                                       self.vocab_size)
        valid_BS = jnp.arange(self.max_len)[None, :] < lengths_B[:, None]
        src_BS = jnp.where(valid_BS, tokens_BS, self.pad_id).astype(jnp.int32)
        return self._assemble(src_BS, lengths_B)

    def _assemble(self, src_BS, lengths_B) -> Batch:
        target_BS = self.targets(src_BS, lengths_B)
        batch_size = src_BS.shape[0]
        bos_B1 = jnp.full((batch_size, 1), self.bos_id, jnp.int32)
        pad_B1 = jnp.full((batch_size, 1), self.pad_id, jnp.int32)
        tgt_in_BT = jnp.concatenate([bos_B1, target_BS], axis=1)
        labels_BT = jnp.concatenate([target_BS, pad_B1], axis=1)
        # EOS goes right after the last target token, at index `length`.
        eos_BT = jnp.arange(self.tgt_len)[None, :] == lengths_B[:, None]
        labels_BT = jnp.where(eos_BT, self.eos_id, labels_BT).astype(jnp.int32)
        return Batch(src_BS, tgt_in_BT.astype(jnp.int32), labels_BT)

    @functools.partial(jax.jit, static_argnums=(0, 2))
    def train_batch(self, key: jax.Array, batch_size: int) -> Batch:
        """A training batch: `sample` with every held-out source removed.

        Draws `_OVERSAMPLE * batch_size` candidates and keeps the first
        `batch_size` that are not held out (a stable sort keeps it
        deterministic). In the unlikely case that too few survive (each
        candidate is held out with probability 1/16, so for batch 32 the
        chance is below 1e-60), the remaining rows become empty examples
        (all-PAD source and labels) that carry no loss: the training stream
        never contains a held-out sequence. Jittable; a pure function of `key`.
        """
        candidates = self.sample(key, _OVERSAMPLE * batch_size)
        held_C = is_heldout(candidates.src, self.pad_id)
        order = jnp.argsort(held_C.astype(jnp.int32), stable=True)[:batch_size]
        picked = jax.tree_util.tree_map(lambda x: x[order], candidates)
        held_B1 = held_C[order][:, None]
        src = jnp.where(held_B1, self.pad_id, picked.src)
        tgt_in = jnp.where(held_B1 & (jnp.arange(self.tgt_len) > 0), self.pad_id, picked.tgt_in)
        labels = jnp.where(held_B1, self.pad_id, picked.labels)
        return Batch(src, tgt_in, labels)

    def heldout_set(self, num_examples: int, seed: int = 0) -> Batch:
        """`num_examples` distinct held-out examples (numpy arrays), drawn with jax.random.

        Sources are drawn from the task distribution and kept iff held out and
        not seen before, so the set follows the task distribution conditioned
        on the held-out partition (short lengths have few distinct sequences,
        so the set leans slightly towards longer ones).
        """
        if not isinstance(num_examples, int) or num_examples <= 0:
            raise ValueError(f"num_examples must be a positive int, got {num_examples!r}")
        key = jax.random.fold_in(jax.random.PRNGKey(seed), 0x48454C44)  # "HELD": own stream
        chunk = 4096
        seen, rows = set(), []
        attempt = stale = 0
        while stale < 10:  # ten draws of 4096 without a new sequence: the space is exhausted
            cand = jax.device_get(self.sample(jax.random.fold_in(key, attempt), chunk))
            attempt, before = attempt + 1, len(rows)
            held = np.asarray(is_heldout(jnp.asarray(cand.src), self.pad_id))
            for i in np.flatnonzero(held):
                signature = cand.src[i].tobytes()
                if signature not in seen:
                    seen.add(signature)
                    rows.append((cand.src[i], cand.tgt_in[i], cand.labels[i]))
                    if len(rows) == num_examples:
                        return Batch(*(np.stack(column) for column in zip(*rows)))
            stale = stale + 1 if len(rows) == before else 0
        raise ValueError(f"could not find {num_examples} distinct held-out sequences for "
                         f"{self}: the task has too few distinct sequences")


def make_task(name: str = "copy", *, vocab_size: int = 32, min_len: int = 1,
              max_len: int = 10, pad_id: int = 0, bos_id: int = 1, eos_id: int = 2) -> Task:
    """Validated `Task`; raises ValueError naming the bad argument."""
    if name not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {name!r}")
    specials = (pad_id, bos_id, eos_id)
    if len(set(specials)) != 3 or min(specials) < 0:
        raise ValueError(f"pad_id/bos_id/eos_id must be distinct non-negative ints, got "
                         f"{specials}")
    first = max(specials) + 1
    if not isinstance(vocab_size, int) or vocab_size < first + 2:
        raise ValueError(f"vocab_size must be an int >= {first + 2} (ids below {first} are "
                         f"PAD/BOS/EOS), got {vocab_size!r}")
    if not isinstance(min_len, int) or min_len < 1:
        raise ValueError(f"min_len must be an int >= 1, got {min_len!r}")
    if not isinstance(max_len, int) or max_len < min_len:
        raise ValueError(f"max_len must be an int >= min_len={min_len}, got {max_len!r}")
    return Task(name, vocab_size, min_len, max_len, pad_id, bos_id, eos_id)


@jax.jit
def sequence_hash(src_BS: jnp.ndarray) -> jnp.ndarray:
    """(B, S) int ids -> (B,) uint32: FNV-1a over the ids, then murmur3's finaliser."""
    tokens_BS = src_BS.astype(jnp.uint32)
    h_B = jnp.full(src_BS.shape[:1], 2166136261, jnp.uint32)
    for s in range(src_BS.shape[1]):  # S is small and static: an unrolled loop
        h_B = (h_B ^ tokens_BS[:, s]) * jnp.uint32(16777619)
    h_B = h_B ^ (h_B >> 16)
    h_B = h_B * jnp.uint32(0x85EBCA6B)
    h_B = h_B ^ (h_B >> 13)
    h_B = h_B * jnp.uint32(0xC2B2AE35)
    return h_B ^ (h_B >> 16)


@functools.partial(jax.jit, static_argnames="pad_id")
def is_heldout(src_BS: jnp.ndarray, pad_id: int = 0) -> jnp.ndarray:
    """(B, S) -> (B,) bool: the source is in the held-out partition.

    The hash covers the whole PAD-filled row (PAD hashed as 0), so membership
    is defined per (sequence, S); tasks always pad sources to their max_len.
    """
    ids_BS = jnp.where(src_BS == pad_id, 0, src_BS)
    return sequence_hash(ids_BS) % HELDOUT_BUCKETS == 0

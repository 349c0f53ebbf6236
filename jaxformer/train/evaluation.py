"""Held-out evaluation: teacher-forced sums and greedy exact match (tasks), bits per byte (LM)."""

from __future__ import annotations

import functools
import math
import numbers
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxformer.config import TransformerConfig
from jaxformer.decode.api import greedy_decode
from jaxformer.nn import checks
from jaxformer.nn.model import DecoderOnlyLM, Transformer
from jaxformer.parallel import partitioning
from jaxformer.parallel.partitioning import make_mesh
from jaxformer.parallel.sharding import data_sharding, shard_batch
from jaxformer.train.data import LMBatch, TextData
from jaxformer.train.loss import (chunked_lm_loss, label_pad_id, loss_and_metrics,
                                  loss_chunk_length, model_logits)
from jaxformer.train.tasks import Batch


@functools.lru_cache(maxsize=16)  # one compilation per model config, not per call
def make_eval_step(model) -> Callable:
    """jit(eval_step)(params, batch) -> sums {loss_sum, correct, tokens} (teacher forcing).

    Sums, not means, so that chunks of a large evaluation set add up exactly.
    """
    def eval_step(params, batch):
        logits_BTV, labels_BT, weights_BT = model_logits(model, params, batch)
        loss, metrics = loss_and_metrics(logits_BTV, labels_BT,
                                         label_pad_id(model.config, weights_BT),
                                         weights_BT=weights_BT)
        return {"loss_sum": loss * metrics["tokens"],
                "correct": metrics["token_accuracy"] * metrics["tokens"],
                "tokens": metrics["tokens"]}

    return jax.jit(eval_step)


@functools.lru_cache(maxsize=16)
def make_lm_eval_step(model: DecoderOnlyLM, loss_chunk_tokens: Optional[int] = None
                      ) -> Callable:
    """jit(step)(params, batch, token_bytes_V) -> sums {nats, tokens, bytes} over weighted labels.

    Where the batch's logits are large (a pretrained vocabulary: `loss_chunk_length`
    of `loss_chunk_tokens`, None = auto, 0 = never), the cross-entropy is computed over
    chunks of positions (`chunked_lm_loss`), so no (B, T, V) array is built and larger
    batches fit."""

    def step(params, batch: LMBatch, token_bytes_V):
        pad_id = label_pad_id(model.config, batch.weights)
        weights_BT = batch.weights if pad_id is None else \
            batch.weights * (batch.labels != pad_id)
        sums = {"tokens": weights_BT.sum(),
                "bytes": (token_bytes_V[batch.labels] * weights_BT).sum()}
        tc = loss_chunk_length(model, batch, loss_chunk_tokens)
        if tc:
            loss, metrics = chunked_lm_loss(model, params, batch, tc)
            return dict(sums, nats=loss * metrics["tokens"])
        logits_BTV, labels_BT, _ = model_logits(model, params, batch)
        xent_BT = optax.softmax_cross_entropy_with_integer_labels(
            logits_BTV.astype(jnp.float32), labels_BT)
        return dict(sums, nats=(xent_BT * weights_BT).sum())

    return jax.jit(step)


@functools.lru_cache(maxsize=4)
def token_byte_counts(tokenizer) -> np.ndarray:
    """(V,) the UTF-8 bytes each token id stands for (0 for the specials)."""
    return np.array([tokenizer.byte_count(np.array([i], np.int32))
                     for i in range(tokenizer.vocab_size)], np.float32)


def evaluate_lm(model: DecoderOnlyLM, params, data: TextData, *, batch_size: int = 32,
                mesh=None, progress: bool = False,
                loss_chunk_tokens: Optional[int] = None) -> dict:
    """Held-out metrics of a decoder-only LM on every held-out window of `data`.

    Returns {"loss" (nats per token), "perplexity", "bits_per_byte", "tokens",
    "bytes"}: bits per byte = total cross-entropy in bits over the UTF-8 bytes
    the predicted tokens stand for, comparable across tokenizers (and with a
    compressor's output size). `progress`: a progress bar over the held-out
    batches (on stderr; it disappears when done).

    One compiled shape: every batch holds `batch_size` windows (fewer when there
    are fewer windows, rounded up to the mesh's batch shards), the last one filled
    with all-PAD rows of weight 0. `loss_chunk_tokens`: as `TrainConfig`'s (the
    cross-entropy over chunks of tokens where the logits are large).
    """
    from tqdm.auto import tqdm  # noqa: PLC0415

    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or \
            batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    mesh = make_mesh() if mesh is None else mesh
    shards = partitioning.batch_shards(mesh)
    batch_size = min(batch_size, -(-max(data.num_eval_windows, 1) // shards) * shards)
    batch_size = max(batch_size - batch_size % shards, shards)
    step = make_lm_eval_step(model, loss_chunk_tokens)
    token_bytes_V = jnp.asarray(token_byte_counts(data.tokenizer), jnp.float32)
    params = partitioning.place_params(model, params, mesh)  # as `evaluate`
    sums = {"nats": 0.0, "tokens": 0.0, "bytes": 0.0}
    batches = tqdm(data.eval_batches(batch_size), disable=not progress, leave=False,
                   total=-(-data.num_eval_windows // batch_size), unit="batch",
                   desc="held-out evaluation", dynamic_ncols=True)
    for batch in batches:
        for name, value in jax.device_get(step(params, shard_batch(batch, mesh),
                                               token_bytes_V)).items():
            sums[name] += float(value)
    loss = sums["nats"] / max(sums["tokens"], 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)),
            "bits_per_byte": sums["nats"] / math.log(2) / max(sums["bytes"], 1.0),
            "tokens": int(sums["tokens"]), "bytes": int(sums["bytes"])}


def check_batch(config: TransformerConfig, batch: Batch) -> None:
    """Host check of a (concrete) batch: ranks, one batch size, lengths, ids in the vocabularies.

    Raises ValueError naming the field (`batch.src`, ...) before anything is
    dispatched: inside the jitted steps an out-of-range id would only show as
    a NaN loss.
    """
    checks.check_tokens("batch.src", batch.src, config.src_vocab_size, config.max_len)
    for name in ("tgt_in", "labels"):
        checks.check_tokens(f"batch.{name}", getattr(batch, name), config.tgt_vocab_size,
                            config.max_len)
    checks.check_same_batch(**{f"batch.{k}": v for k, v in batch._asdict().items()})
    if batch.tgt_in.shape != batch.labels.shape:
        raise ValueError(f"batch.tgt_in {batch.tgt_in.shape} and batch.labels "
                         f"{batch.labels.shape} must have the same shape")


def make_predict(model: Transformer, max_new_tokens: int) -> Callable:
    """predict(params, src_BS) -> greedy tokens (B, max_new_tokens), PAD after EOS.

    `jaxformer.decode.api.greedy_decode` (cached, compiled once per shape).
    """
    def predict(params, src_BS):
        return greedy_decode(model, params, src_BS, max_new_tokens=max_new_tokens).tokens

    return predict


def _init_inputs(*arrays) -> tuple:
    """(1, ...) ShapeDtypeStructs of `arrays`' rows: what `model.init` takes."""
    return tuple(jax.ShapeDtypeStruct((1,) + x.shape[1:], x.dtype) for x in arrays)


def evaluate(model: Transformer, params, batch: Batch, *, mesh=None, chunk: int = 1000,
             eval_step: Optional[Callable] = None,
             predict: Optional[Callable] = None) -> dict:
    """Metrics of `params` on a (held-out) batch, in chunks sharded over the mesh.

    `params` are placed by the logical-axis rules (`partitioning.place_params`):
    split over the mesh's "fsdp" and "tensor" axes, replicated over "data".
    Returns {"loss", "token_accuracy"} (teacher-forced, over non-PAD labels),
    "exact_match" (fraction of examples whose greedy decode equals labels
    exactly, EOS included) and "examples". The last chunk is padded to a
    multiple of the device count with copies of its first row, which are
    dropped from every metric.
    """
    batch = Batch(*(np.asarray(x) for x in batch))
    check_batch(model.config, batch)
    mesh = make_mesh() if mesh is None else mesh
    eval_step = make_eval_step(model) if eval_step is None else eval_step
    predict = make_predict(model, batch.labels.shape[1]) if predict is None else predict
    # Split by the rules over fsdp / tensor (a model no device holds whole still
    # evaluates), replicated over data; a no-op if already there.
    params = partitioning.place_params(model, params, mesh, *_init_inputs(batch.src,
                                                                          batch.tgt_in))
    total = batch.src.shape[0]
    devices = partitioning.batch_shards(mesh)  # rows per chunk: a multiple of this
    chunk = max(devices, chunk - chunk % devices)
    sums = {"loss_sum": 0.0, "correct": 0.0, "tokens": 0.0}
    exact = 0
    for start in range(0, total, chunk):
        part = Batch(*(x[start:start + chunk] for x in batch))
        rows = part.src.shape[0]
        padded = -rows % devices
        if padded:
            part = Batch(*(np.concatenate([x, np.repeat(x[:1], padded, 0)]) for x in part))
        weights = np.arange(rows + padded) < rows
        sharded = shard_batch(part, mesh)
        if padded:  # teacher-forced sums must not count the filler rows
            sharded = sharded._replace(labels=jnp.where(
                jax.device_put(weights[:, None], data_sharding(mesh)), sharded.labels,
                model.config.pad_id))
        for name, value in jax.device_get(eval_step(params, sharded)).items():
            sums[name] += float(value)
        tokens = np.asarray(jax.device_get(predict(params, sharded.src)))
        exact += int(np.all(tokens == part.labels, axis=1)[weights].sum())
    return {"loss": sums["loss_sum"] / max(sums["tokens"], 1.0),
            "token_accuracy": sums["correct"] / max(sums["tokens"], 1.0),
            "exact_match": exact / total, "examples": total}

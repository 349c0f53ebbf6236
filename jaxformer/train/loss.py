"""The loss: token cross-entropy over the labels that count, and the model's logits of a batch."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import optax

from jaxformer.config import TransformerConfig
from jaxformer.nn.attention_select import uses_mask_spec
from jaxformer.train.chunked_loss import chunk_length, chunked_loss_and_metrics
from jaxformer.train.data import LMBatch, segment_mask, segment_mask_spec


def loss_and_metrics(logits_BTV: jnp.ndarray, labels_BT: jnp.ndarray,
                     pad_id: Optional[int] = 0, label_smoothing: float = 0.0,
                     weights_BT: Optional[jnp.ndarray] = None) -> tuple[jnp.ndarray, dict]:
    """Mean token cross-entropy over non-PAD labels, and metrics.

    Returns (loss, {"loss", "token_accuracy", "tokens"}). PAD labels get
    weight 0 (so a PAD label's value changes nothing); the mean is over the
    non-PAD tokens of the whole (global) batch. `weights_BT` (0/1) masks more
    labels (a packed LM batch: no label across a document boundary). With
    `label_smoothing` a the target is (1 - a) one_hot + a / V.

    `pad_id=None`: no label is PAD by its id, `weights_BT` alone is the mask
    (required). For a model whose PAD id is also its EOS id (`label_pad_id`):
    a test `labels != pad_id` would drop every EOS label from the loss, and
    the model would never learn to stop.
    """
    logits_BTV = logits_BTV.astype(jnp.float32)
    if pad_id is None:
        if weights_BT is None:
            raise ValueError("loss_and_metrics: pad_id=None needs weights_BT (the mask)")
        weights_BT = jnp.asarray(weights_BT, jnp.float32)
    else:
        weights_BT = (labels_BT != pad_id).astype(jnp.float32) * (
            1.0 if weights_BT is None else weights_BT)
    if label_smoothing > 0.0:
        targets_BTV = optax.smooth_labels(
            jax.nn.one_hot(labels_BT, logits_BTV.shape[-1]), label_smoothing)
        xent_BT = optax.softmax_cross_entropy(logits_BTV, targets_BTV)
    else:
        xent_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, labels_BT)
    tokens = weights_BT.sum()
    denominator = jnp.maximum(tokens, 1.0)  # an all-PAD batch has loss 0, not NaN
    loss = (xent_BT * weights_BT).sum() / denominator
    correct = ((logits_BTV.argmax(-1) == labels_BT) * weights_BT).sum()
    return loss, {"loss": loss, "token_accuracy": correct / denominator, "tokens": tokens}


def label_pad_id(config: TransformerConfig, weights_BT) -> Optional[int]:
    """The `pad_id` that `loss_and_metrics` masks labels by, for a batch of `config`'s model.

    `config.pad_id`, or None (the batch's weights are the mask) when PAD is
    also EOS (allowed in configs: many tokenizers reuse EOS as PAD): there a
    label equal to pad_id may be a real EOS, which must count. A batch without
    weights (a task `Batch`: labels = target + EOS, then PAD) cannot tell them
    apart, so it is refused, before anything compiles.
    """
    if config.pad_id != config.eos_id:
        return config.pad_id
    if weights_BT is None:
        raise ValueError(
            f"pad_id == eos_id == {config.pad_id}: a batch without weights (a task Batch) "
            f"cannot tell its EOS labels from PAD labels, and masking labels != pad_id would "
            f"drop every EOS label from the loss (the model would never learn to stop). "
            f"Give PAD its own id in the config for training, or train on batches that "
            f"carry weights (data.LMBatch: weights 1 exactly where a label counts)")
    return None


def lm_mask(model, batch: LMBatch):
    """The attention mask of a packed LM batch: attention stays inside each document."""
    return (segment_mask_spec if uses_mask_spec(model.config) else segment_mask)(
        batch.segments)


def model_logits(model, params, batch, *, deterministic: bool = True, rngs=None):
    """(logits (B, T, V), labels (B, T), weights (B, T) or None) of either kind of batch.

    A task `Batch` runs the encoder-decoder with teacher forcing; an `LMBatch`
    runs the decoder-only LM on packed windows: attention stays inside each
    document (`data.segment_mask`; as a MaskSpec, `data.segment_mask_spec`, under
    attention_impl "blockwise" or "auto": no (T, T) array) and positions restart
    with each document.
    """
    if isinstance(batch, LMBatch):
        logits_BTV = model.apply({"params": params}, batch.inputs, lm_mask(model, batch),
                                 positions_BT=batch.positions, deterministic=deterministic,
                                 rngs=rngs)
        return logits_BTV, batch.labels, batch.weights
    logits_BTV = model.apply({"params": params}, batch.src, batch.tgt_in,
                             deterministic=deterministic, rngs=rngs)
    return logits_BTV, batch.labels, None


def loss_chunk_length(model, batch, chunk_tokens: Optional[int]) -> int:
    """Positions per chunk of the chunked LM loss for this batch, or 0 (the plain loss):
    only a decoder-only LM's `LMBatch` is chunked (`chunked_loss.chunk_length`:
    `chunk_tokens` None = auto, where the batch's logits are large)."""
    if not (isinstance(batch, LMBatch) and hasattr(model, "output_logits")):
        return 0
    b, t = batch.labels.shape
    return chunk_length(b, t, model.config.tgt_vocab_size, chunk_tokens)


def output_params(config: TransformerConfig, params) -> dict:
    """The part of a DecoderOnlyLM's `params` that its output projection reads
    (`DecoderOnlyLM.output_logits`): the tied embedding or the own kernel, and the bias."""
    keep = {"embed": params["embed"]} if config.tie_output_embedding else {}
    decoder = {k: v for k, v in params["decoder"].items() if k in ("out_proj", "logits_bias")}
    if decoder:
        keep["decoder"] = decoder
    return keep


def chunked_lm_loss(model, params, batch: LMBatch, tc: int, *, deterministic: bool = True,
                    rngs=None, label_smoothing: float = 0.0, project_grads: bool = True
                    ) -> tuple[jnp.ndarray, dict]:
    """`loss_and_metrics` of a decoder-only LM on an `LMBatch`, the logits computed
    Tc positions at a time (`chunked_loss`): the same loss and gradients without the
    (B, T, V) logits. `project_grads=False`: the output projection is frozen (LoRA)."""
    hidden_BTD = model.apply({"params": params}, batch.inputs, lm_mask(model, batch),
                             positions_BT=batch.positions, deterministic=deterministic,
                             rngs=rngs, hidden=True)
    pad_id = label_pad_id(model.config, batch.weights)
    weights_BT = batch.weights if pad_id is None else (batch.labels != pad_id) * (
        1.0 if batch.weights is None else batch.weights)

    def project(proj_params, h_BcD):
        return model.apply({"params": proj_params}, h_BcD, method=type(model).output_logits)

    return chunked_loss_and_metrics(project, output_params(model.config, params), hidden_BTD,
                                    batch.labels, weights_BT, tc,
                                    label_smoothing=label_smoothing,
                                    project_grads=project_grads)

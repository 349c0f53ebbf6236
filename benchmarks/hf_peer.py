"""The peer a user would pick instead: Hugging Face `transformers.MarianMTModel`.

MarianMT is the seeds' exact architecture (Post-LN, sinusoidal positions,
embeddings scaled by sqrt(d_model), ReLU FFN), so it runs the "bench" sizes
as they are: random weights, eager PyTorch on the CPU. Used by
benchmarks/decode.py (greedy `generate` with its KV cache) and
benchmarks/train.py (forward + backward + AdamW with dropout on).

transformers is the optional `bench` extra; `load()` returns None (and the
benchmarks print why and skip the column) when it is absent.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

BOS, EOS, PAD = 1, 2, 0  # jaxformer's default special ids, used on both sides


def load() -> Optional[object]:
    """The `transformers` module, or None with a message saying how to get it."""
    try:
        import transformers  # noqa: PLC0415
    except ImportError:
        print("transformers is not installed: the Hugging Face column is skipped "
              "(pip install -e '.[bench]')")
        return None
    transformers.logging.set_verbosity_error()  # no generation-config chatter in the table
    return transformers


def marian(transformers, config, *, train: bool):
    """A MarianMTModel of `config`'s sizes (a jaxformer TransformerConfig), seeded."""
    import torch  # noqa: PLC0415

    assert config.src_vocab_size == config.tgt_vocab_size, "Marian shares one vocabulary"
    torch.manual_seed(0)
    hf_config = transformers.MarianConfig(
        vocab_size=config.tgt_vocab_size, d_model=config.d_model,
        encoder_layers=config.num_encoder_layers, decoder_layers=config.num_decoder_layers,
        encoder_attention_heads=config.num_heads, decoder_attention_heads=config.num_heads,
        encoder_ffn_dim=config.d_ff, decoder_ffn_dim=config.d_ff, activation_function="relu",
        dropout=config.residual_dropout, attention_dropout=config.attention_dropout,
        activation_dropout=config.ffn_dropout, max_position_embeddings=config.max_len,
        scale_embedding=True, pad_token_id=PAD, decoder_start_token_id=BOS,
        # No EOS: generate runs every one of max_new_tokens steps, as jaxformer's scan does.
        eos_token_id=None, forced_eos_token_id=None, bos_token_id=None)
    model = transformers.MarianMTModel(hf_config)
    return model.train() if train else model.eval()


class MarianGreedy:
    """Greedy `generate` with the KV cache (use_cache=True), EOS off: all N steps run."""

    def __init__(self, transformers, config, src_np: np.ndarray):
        import torch  # noqa: PLC0415

        self.torch = torch
        self.model = marian(transformers, config, train=False)
        self.src = torch.as_tensor(src_np, dtype=torch.long)
        self.mask = (self.src != PAD).long()

    def __call__(self, new_tokens: int):
        with self.torch.inference_mode():
            out = self.model.generate(input_ids=self.src, attention_mask=self.mask,
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      do_sample=False, num_beams=1, use_cache=True)
        return out[:, 1:]  # the decoder start token is not generated


class MarianTrainStep:
    """Forward + backward + AdamW (+ clipping, as jaxformer's step) on one fixed batch."""

    def __init__(self, transformers, config, batch_np, learning_rate: float = 1e-4):
        import torch  # noqa: PLC0415

        self.model = marian(transformers, config, train=True)  # dropout on
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=learning_rate)
        self.src = torch.from_numpy(np.array(batch_np.src)).long()
        self.tgt_in = torch.from_numpy(np.array(batch_np.tgt_in)).long()
        labels = torch.from_numpy(np.array(batch_np.labels)).long()
        self.labels = labels.masked_fill(labels == PAD, -100)  # HF's ignore index
        self.src_mask = (self.src != PAD).long()
        self.tgt_mask = (self.tgt_in != PAD).long()
        self.clip = torch.nn.utils.clip_grad_norm_

    def __call__(self) -> float:
        out = self.model(input_ids=self.src, attention_mask=self.src_mask,
                         decoder_input_ids=self.tgt_in, decoder_attention_mask=self.tgt_mask,
                         labels=self.labels)
        self.optim.zero_grad()
        out.loss.backward()
        self.clip(self.model.parameters(), 1.0)
        self.optim.step()
        return out.loss.item()

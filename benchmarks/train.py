"""Training throughput on the "bench" workload: jaxformer vs seed 001's PyTorch model.

Workload (../shared/DESIGN.md "bench"): vocab 100, d_model 256, 8 heads, d_ff
1024, 4 encoder + 4 decoder layers, dropout 0.1 while training, float32,
batch 32, source length 32, copy task (target input = BOS + source, labels =
source + EOS, so T = 33). Both sides train on the same batch every step
(data generation is not timed):

  jaxformer   `jaxformer.training`: the jitted train step of `jaxformer train`
              (AdamW + clipping + schedule, the state donated), compiled once.
  seed torch  seed 001's PyTorch classes, copied below unchanged, trained the
              way seed 001 trains them: CrossEntropyLoss(ignore_index=0), Adam,
              zero_grad / backward / step; eager PyTorch at its default thread
              count (= cores; 1 thread measured slower here: ~0.87 vs ~0.59 s/step).

They alternate in windows of --steps steps (--rounds times) so that load from
other processes hits both alike; the figures are medians over the windows.
tokens/s = B * (S + T) / (seconds per step), source and target tokens both
processed. compile_s: jaxformer's lower + compile of the train step; the
torch column reports its first (warm-up) step for comparison.

The ceiling: a plain float32 (2048 x 2048) @ (2048 x 2048) matmul, timed in
this run with both jax and torch; the faster is the machine's peak FLOP/s.
Model FLOPs per train step are counted analytically (3 x the forward's matmul
and attention FLOPs: forward + two backward products) and the same count is
used for both implementations; fraction_of_matmul_peak = FLOPs/s / peak.

Run (about 3 minutes on 2 CPU cores; run it when the machine is quiet):
  nice -n 5 python benchmarks/train.py
Prints a table, then one JSON line with tokens_per_s, compile_s,
ratio_vs_seed_torch, fraction_of_matmul_peak and the other figures.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn as nn
from torch import Tensor

import jaxformer as jf
from jaxformer.training import TrainConfig, train_functions

# ---------------------------------------------------------------------------
# Seed 001 (../shared/seeds/001_507dfbbf7d5b0114.txt), copied unchanged: the peer.
# ---------------------------------------------------------------------------

class ScaledDotProductAttention(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.dropout = nn.Dropout(dropout)

    def forward(self, Q: Tensor, K: Tensor, V: Tensor, mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """
        Q: (B, H, T_q, d_k)
        K: (B, H, T_k, d_k)
        V: (B, H, T_k, d_v)
        mask: (B, 1, T_q, T_k) 或 (B, H, T_q, T_k), 1表示可见, 0表示遮挡
        返回: (out, attn)
          out: (B, H, T_q, d_v)
          attn: (B, H, T_q, T_k)
        """
        d_k = Q.size(-1)
        scores = (Q @ K.transpose(-2, -1)) / math.sqrt(d_k)  # (B,H,T_q,T_k)
        if mask is not None:
            # 将不可见位置置为 -inf
            scores = scores.masked_fill(mask == 0, float('-inf'))
        attn = scores.softmax(dim=-1)
        attn = self.dropout(attn)
        out = attn @ V  # (B,H,T_q,d_v)
        return out, attn

class MultiHeadAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.0):
        super().__init__()
        assert d_model % num_heads == 0, "d_model must be divisible by num_heads"
        self.d_model = d_model
        self.num_heads = num_heads
        self.d_k = d_model // num_heads

        self.W_q = nn.Linear(d_model, d_model)
        self.W_k = nn.Linear(d_model, d_model)
        self.W_v = nn.Linear(d_model, d_model)
        self.W_o = nn.Linear(d_model, d_model)

        self.attn = ScaledDotProductAttention(dropout)
        self.dropout = nn.Dropout(dropout)

    def _split_heads(self, x: Tensor) -> Tensor:
        # x: (B,T,d_model) -> (B,H,T,d_k)
        B, T, _ = x.shape
        x = x.view(B, T, self.num_heads, self.d_k).transpose(1, 2)
        return x

    def _combine_heads(self, x: Tensor) -> Tensor:
        # x: (B,H,T,d_k) -> (B,T,d_model)
        B, H, T, d_k = x.shape
        x = x.transpose(1, 2).contiguous().view(B, T, H * d_k)
        return x

    def forward(self, x_q: Tensor, x_kv: Tensor, mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """
        x_q: (B,T_q,d_model)
        x_kv: (B,T_k,d_model)
        mask: (B,1,T_q,T_k) 或 (B,H,T_q,T_k)
        返回: (out, attn)
        """
        Q = self._split_heads(self.W_q(x_q))  # (B,H,T_q,d_k)
        K = self._split_heads(self.W_k(x_kv)) # (B,H,T_k,d_k)
        V = self._split_heads(self.W_v(x_kv)) # (B,H,T_k,d_k)

        out, attn = self.attn(Q, K, V, mask)   # out: (B,H,T_q,d_k)
        out = self._combine_heads(out)         # (B,T_q,d_model)
        out = self.W_o(out)                    # (B,T_q,d_model)
        out = self.dropout(out)
        return out, attn

class PositionalEncoding(nn.Module):
    def __init__(self, d_model: int, max_len: int = 5000, dropout: float = 0.0):
        super().__init__()
        pe = torch.zeros(max_len, d_model)  # (T, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)  # (T,1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer('pe', pe.unsqueeze(0))  # (1,T,d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        # x: (B,T,d_model)
        T = x.size(1)
        x = x + self.pe[:, :T, :]
        return self.dropout(x)

class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0, activation: str = 'relu'):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)
        if activation == 'relu':
            self.act = nn.ReLU()
        elif activation == 'gelu':
            self.act = nn.GELU()
        else:
            raise ValueError('activation must be relu or gelu')

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.dropout(self.act(self.fc1(x))))

class ResidualLayerNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        self.ln = nn.LayerNorm(d_model, eps=eps)

    def forward(self, x: Tensor, sublayer_out: Tensor) -> Tensor:
        # x + sublayer(x) 再做 LN
        return self.ln(x + sublayer_out)

def make_pad_mask(q_len: int, k_len: int, q_pad: Tensor | None, k_pad: Tensor | None) -> Tensor:
    """
    构造 padding mask（1 可见, 0 屏蔽），形状 (B,1,q_len,k_len)
    q_pad/k_pad: (B,T) 中 1 表示 pad 位置
    """
    if q_pad is None and k_pad is None:
        return None
    if q_pad is None:
        q_mask = torch.zeros_like(k_pad)
    else:
        q_mask = q_pad
    if k_pad is None:
        k_mask = torch.zeros_like(q_mask)
    else:
        k_mask = k_pad
    # 可见位置=1，即非pad
    q_visible = (q_mask == 0).unsqueeze(2)  # (B,T_q,1)
    k_visible = (k_mask == 0).unsqueeze(1)  # (B,1,T_k)
    mask = q_visible & k_visible            # (B,T_q,T_k)
    return mask.unsqueeze(1)                # (B,1,T_q,T_k)


def make_subsequent_mask(T: int) -> Tensor:
    """Decoder 自注意力的下三角可见性掩码（1 可见, 0 屏蔽），形状 (1,1,T,T)"""
    return torch.tril(torch.ones(T, T, dtype=torch.bool)).unsqueeze(0).unsqueeze(0)


class EncoderLayer(nn.Module):
    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, num_heads, dropout)
        self.ffn = FeedForward(d_model, d_ff, dropout)
        self.norm1 = ResidualLayerNorm(d_model)
        self.norm2 = ResidualLayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, src_mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        # Self-Attention
        sa_out, sa_w = self.self_attn(x, x, src_mask)
        x = self.norm1(x, self.dropout(sa_out))
        # FFN
        ff_out = self.ffn(x)
        x = self.norm2(x, self.dropout(ff_out))
        return x, sa_w


class DecoderLayer(nn.Module):
    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, num_heads, dropout)
        self.cross_attn = MultiHeadAttention(d_model, num_heads, dropout)
        self.ffn = FeedForward(d_model, d_ff, dropout)
        self.norm1 = ResidualLayerNorm(d_model)
        self.norm2 = ResidualLayerNorm(d_model)
        self.norm3 = ResidualLayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, y: Tensor, memory: Tensor, tgt_mask: Optional[Tensor], memory_mask: Optional[Tensor]) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        # Masked Self-Attention (decoder)
        sa_out, sa_w = self.self_attn(y, y, tgt_mask)
        y = self.norm1(y, self.dropout(sa_out))
        # Cross-Attention: Q=decoder, K/V=encoder memory
        ca_out, ca_w = self.cross_attn(y, memory, memory_mask)
        y = self.norm2(y, self.dropout(ca_out))
        # FFN
        ff_out = self.ffn(y)
        y = self.norm3(y, self.dropout(ff_out))
        return y, (sa_w, ca_w)


class Transformer(nn.Module):
    def __init__(self, src_vocab: int, tgt_vocab: int, d_model: int = 256, num_heads: int = 8,
                 d_ff: int = 512, num_layers: int = 4, dropout: float = 0.1, max_len: int = 512):
        super().__init__()
        # src_vocab: 源端（输入）词表大小，例如包含 PAD/BOS/EOS 等特殊 token
        # tgt_vocab: 目标端（输出）词表大小，用于最后的线性投影到词表概率
        self.src_embed = nn.Embedding(src_vocab, d_model)
        self.tgt_embed = nn.Embedding(tgt_vocab, d_model)
        self.pos_enc = PositionalEncoding(d_model, max_len, dropout)

        self.encoder_layers = nn.ModuleList([
            EncoderLayer(d_model, num_heads, d_ff, dropout) for _ in range(num_layers)
        ])
        self.decoder_layers = nn.ModuleList([
            DecoderLayer(d_model, num_heads, d_ff, dropout) for _ in range(num_layers)
        ])
        self.out_proj = nn.Linear(d_model, tgt_vocab)

    def encode(self, src: Tensor, src_pad: Optional[Tensor] = None) -> tuple[Tensor, list[Tensor]]:
        # src: (B,T_s), src_pad: (B,T_s) 1=pad
        x = self.pos_enc(self.src_embed(src))  # (B,T_s,d_model)
        attn_weights = []
        src_len = src.size(1)
        src_mask = make_pad_mask(src_len, src_len, src_pad, src_pad)  # (B,1,T,T)
        for layer in self.encoder_layers:
            x, sa_w = layer(x, src_mask)
            attn_weights.append(sa_w)
        return x, attn_weights

    def decode(self, tgt: Tensor, memory: Tensor, src_pad: Optional[Tensor] = None, tgt_pad: Optional[Tensor] = None) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        # tgt: (B,T_t)
        y = self.pos_enc(self.tgt_embed(tgt))
        T_t = tgt.size(1)
        B, T_s = memory.size(0), memory.size(1)
        # masks
        pad_mask = make_pad_mask(T_t, T_t, tgt_pad, tgt_pad)            # (B,1,T_t,T_t)
        subs_mask = make_subsequent_mask(T_t).to(y.device)              # (1,1,T_t,T_t)
        tgt_mask = pad_mask & subs_mask if pad_mask is not None else subs_mask
        mem_mask = make_pad_mask(T_t, T_s, tgt_pad, src_pad)            # (B,1,T_t,T_s)

        attn_pairs = []
        for layer in self.decoder_layers:
            y, (sa_w, ca_w) = layer(y, memory, tgt_mask, mem_mask)
            attn_pairs.append((sa_w, ca_w))
        return y, attn_pairs

    def forward(self, src: Tensor, tgt_inp: Tensor, src_pad: Optional[Tensor] = None, tgt_pad: Optional[Tensor] = None) -> Tensor:
        memory, _ = self.encode(src, src_pad)
        y, _ = self.decode(tgt_inp, memory, src_pad, tgt_pad)
        logits = self.out_proj(y)
        return logits

    @torch.no_grad()
    def greedy_decode(self, src: Tensor, bos_id: int, eos_id: int, max_new_tokens: int,
                      src_pad: Optional[Tensor] = None) -> Tensor:
        """
        Greedy decode using the Transformer (no beam search).

        用途:
        - 在推理阶段从编码器记忆中逐步生成目标序列。
        - 每步选择当前模型概率最高的下一个 token（argmax），直到生成 EOS 或达到最大长度。

        参数说明:
        - src (Tensor): 源序列输入，形状 (B, T_s)，元素为 token id。
        - bos_id (int): 解码起始符 (BOS) 的 token id，用于初始化生成序列。
        - eos_id (int): 结束符 (EOS) 的 token id，遇到后可停止生成（对所有样本均为 EOS 时提前终止）。
        - max_new_tokens (int): 最多生成的新 token 数量（不包括初始 BOS）。
        - src_pad (Optional[Tensor]): 可选的源端 padding 标志，形状 (B, T_s)，1 表示 PAD，用于构造 encoder/decoder 的 mask（若为 None 则不使用 pad 屏蔽）。

        返回:
        - Tensor: 生成的 token id 序列，形状 (B, T_out)，通常包含初始 BOS 和随后生成的 token（可能包含 EOS）。
        """
        self.eval()
        memory, _ = self.encode(src, src_pad)
        B = src.size(0)
        ys = torch.full((B, 1), bos_id, dtype=torch.long, device=src.device)
        for _ in range(max_new_tokens):
            y, _ = self.decode(ys, memory, src_pad, tgt_pad=None)
            logits = self.out_proj(y)  # (B,T,d_vocab)
            next_token = logits[:, -1].argmax(dim=-1, keepdim=True)  # (B,1)
            ys = torch.cat([ys, next_token], dim=1)
            if (next_token == eos_id).all():
                break
        return ys


# ---------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------

BATCH, SRC_LEN = 32, 32


def train_flops(c: jf.TransformerConfig, batch: int, src_len: int, tgt_len: int) -> float:
    """Matmul + attention FLOPs of one training step (3 x forward), embeddings excluded."""
    D, F, V = c.d_model, c.d_ff, c.tgt_vocab_size
    S, T = batch * src_len, batch * tgt_len  # token counts
    macs = c.num_encoder_layers * (S * (4 * D * D + 2 * D * F)            # QKVO + FFN
                                   + 2 * batch * src_len * src_len * D)    # QK^T, AV
    macs += c.num_decoder_layers * (T * (4 * D * D + 2 * D * D + 2 * D * F)  # self, cross QO, FFN
                                    + S * 2 * D * D                        # cross K, V
                                    + 2 * batch * tgt_len * tgt_len * D    # self QK^T, AV
                                    + 2 * batch * tgt_len * src_len * D)   # cross QK^T, AV
    macs += T * D * V                                                      # output projection
    return 3 * 2 * macs


def matmul_peak(n: int = 2048, repeats: int = 10) -> dict:
    """FLOP/s of a plain float32 (n x n) @ (n x n), jax and torch; the median of `repeats`."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    mm = jax.jit(jnp.matmul)
    mm(a, a).block_until_ready()
    jax_times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mm(a, a).block_until_ready()
        jax_times.append(time.perf_counter() - start)
    t = torch.from_numpy(np.array(a))
    torch.mm(t, t)
    torch_times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(t, t)
        torch_times.append(time.perf_counter() - start)
    flops = 2 * n ** 3
    return {"jax": flops / statistics.median(jax_times),
            "torch": flops / statistics.median(torch_times)}


class JaxSide:
    def __init__(self, config: jf.TransformerConfig, batch: int, src_len: int):
        tc = TrainConfig(task="copy", min_len=src_len, max_len=src_len, batch_size=batch,
                         steps=100_000, warmup_steps=100, learning_rate=1e-4)
        self.fns = train_functions(config, tc)
        self.batch = self.fns.batch(0, 0)
        self.state = self.fns.init(0)
        self.step, self.compile_s = self.fns.compiled_step(self.state, self.batch)
        self.first_loss = None

    def run(self, steps: int) -> float:
        """Seconds per step over `steps` steps (dispatch is async; one sync at the end)."""
        start = time.perf_counter()
        for _ in range(steps):
            self.state, metrics = self.step(self.state, self.batch)
        loss = float(metrics["loss"])
        if self.first_loss is None:
            self.first_loss = loss
        self.last_loss = loss
        return (time.perf_counter() - start) / steps


class TorchSide:
    def __init__(self, config: jf.TransformerConfig, batch_np):
        torch.manual_seed(0)
        assert config.num_encoder_layers == config.num_decoder_layers  # the seed has one N
        self.model = Transformer(src_vocab=config.src_vocab_size, tgt_vocab=config.tgt_vocab_size,
                                 d_model=config.d_model, num_heads=config.num_heads,
                                 d_ff=config.d_ff, num_layers=config.num_encoder_layers,
                                 dropout=config.residual_dropout, max_len=config.max_len)
        self.model.train()
        self.criterion = nn.CrossEntropyLoss(ignore_index=0)
        self.optim = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.src = torch.from_numpy(np.asarray(batch_np.src)).long()
        self.tgt_inp = torch.from_numpy(np.asarray(batch_np.tgt_in)).long()
        self.tgt_out = torch.from_numpy(np.asarray(batch_np.labels)).long()
        # The seed passes pad flags (1 = PAD); this batch has none, like the seed's.
        self.src_pad = (self.src == 0).long()
        self.tgt_pad = (self.tgt_inp == 0).long()
        self.vocab = config.tgt_vocab_size
        self.first_loss = None

    def one_step(self) -> float:
        logits = self.model(self.src, self.tgt_inp, self.src_pad, self.tgt_pad)
        loss = self.criterion(logits.reshape(-1, self.vocab), self.tgt_out.reshape(-1))
        self.optim.zero_grad()
        loss.backward()
        self.optim.step()
        return loss.item()

    def run(self, steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            loss = self.one_step()
        if self.first_loss is None:
            self.first_loss = loss
        self.last_loss = loss
        return (time.perf_counter() - start) / steps


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description="train-step throughput, jaxformer vs seed 001")
    parser.add_argument("--steps", type=int, default=5, help="steps per timing window")
    parser.add_argument("--rounds", type=int, default=5, help="alternating windows per side")
    args = parser.parse_args(argv)

    config = jf.bench()
    tgt_len = SRC_LEN + 1
    tokens_per_step = BATCH * (SRC_LEN + tgt_len)
    flops_per_step = train_flops(config, BATCH, SRC_LEN, tgt_len)
    print(f"bench: {jax.devices()[0].platform} x{len(jax.devices())}, torch "
          f"{torch.__version__} ({torch.get_num_threads()} threads), batch {BATCH}, "
          f"S={SRC_LEN}, T={tgt_len}, {flops_per_step / 1e9:.1f} GFLOP per train step",
          flush=True)

    peak_before = matmul_peak()
    jax_side = JaxSide(config, BATCH, SRC_LEN)
    batch_np = jax.device_get(jax_side.batch)
    torch_side = TorchSide(config, batch_np)
    start = time.perf_counter()
    torch_side.one_step()
    torch_first = time.perf_counter() - start
    jax_side.run(1)  # first run of the compiled step (allocations)

    jax_times, torch_times = [], []
    for _ in range(args.rounds):
        jax_times.append(jax_side.run(args.steps))
        torch_times.append(torch_side.run(args.steps))
    peak_after = matmul_peak()
    peak = max(*peak_before.values(), *peak_after.values())

    rows = {}
    for name, times in (("jaxformer", jax_times), ("seed torch", torch_times)):
        step_s = statistics.median(times)
        rows[name] = {"step_s": step_s, "tokens_per_s": tokens_per_step / step_s,
                      "flops_per_s": flops_per_step / step_s,
                      "fraction_of_matmul_peak": flops_per_step / step_s / peak}
    rows["jaxformer"]["compile_s"] = jax_side.compile_s
    rows["seed torch"]["compile_s"] = torch_first

    print(f"matmul peak (float32 2048^3): jax {peak_before['jax'] / 1e9:.1f} / "
          f"{peak_after['jax'] / 1e9:.1f}, torch {peak_before['torch'] / 1e9:.1f} / "
          f"{peak_after['torch'] / 1e9:.1f} GFLOP/s (before / after); peak = "
          f"{peak / 1e9:.1f}")
    print(f"{'':<12}{'step ms':>10}{'tokens/s':>12}{'GFLOP/s':>10}{'of peak':>9}"
          f"{'compile s':>11}  windows (ms)")
    for name, row in rows.items():
        times = jax_times if name == "jaxformer" else torch_times
        print(f"{name:<12}{row['step_s'] * 1e3:>10.1f}{row['tokens_per_s']:>12.0f}"
              f"{row['flops_per_s'] / 1e9:>10.1f}{row['fraction_of_matmul_peak']:>9.2f}"
              f"{row['compile_s']:>11.2f}  {' '.join(f'{t * 1e3:.0f}' for t in times)}")
    print(f"(torch 'compile s' is its first eager step.) losses first/last window: jaxformer "
          f"{jax_side.first_loss:.3f}/{jax_side.last_loss:.3f}, seed torch "
          f"{torch_side.first_loss:.3f}/{torch_side.last_loss:.3f}")
    jax_row, torch_row = rows["jaxformer"], rows["seed torch"]
    summary = {
        "tokens_per_s": round(jax_row["tokens_per_s"], 1),
        "compile_s": round(jax_row["compile_s"], 2),
        "ratio_vs_seed_torch": round(jax_row["tokens_per_s"] / torch_row["tokens_per_s"], 3),
        "fraction_of_matmul_peak": round(jax_row["fraction_of_matmul_peak"], 3),
        "seed_torch_tokens_per_s": round(torch_row["tokens_per_s"], 1),
        "seed_torch_fraction_of_matmul_peak": round(torch_row["fraction_of_matmul_peak"], 3),
        "matmul_peak_gflops": round(peak / 1e9, 1),
        "train_gflop_per_step": round(flops_per_step / 1e9, 2),
        "steps_per_window": args.steps, "rounds": args.rounds,
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()

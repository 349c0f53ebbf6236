"""Seed 004's PyTorch decoder-only layer, the peer of the LM training benchmark.

`SimpleDecoderLayer` is copied verbatim from ../shared/seeds/004_78052d741137b184.txt
(Post-LN, GELU, LayerNorm eps 1e-12, d_ff = 4 x hidden, masked_fill(-1e20)).
The seed's `Decoder` hard-codes its sizes (64 wide, 8 heads, 5 layers, vocab 12)
and returns a softmax; `SeedLM` below is that Decoder with the sizes as
arguments and logits out (what a cross-entropy loss takes). Like the seed, it
has no position encoding.
"""

import math

import torch
import torch.nn as nn


class SimpleDecoderLayer(nn.Module):
    def __init__(self, hidden_dim, head_num, attention_dropout = 0.1):
        super().__init__()

        self.hidden_dim = hidden_dim
        self.head_num = head_num
        self.head_dim = hidden_dim // head_num

        self.q_proj = nn.Linear(hidden_dim, hidden_dim)
        self.k_proj = nn.Linear(hidden_dim, hidden_dim)
        self.v_proj = nn.Linear(hidden_dim, hidden_dim)
        self.out_proj = nn.Linear(hidden_dim, hidden_dim)

        self.att_dropout = nn.Dropout(attention_dropout)

        self.att_ln = nn.LayerNorm(hidden_dim, eps = 1e-12)

        # ffn(升维 -> 降维 -> att_ln)
        self.up_proj = nn.Linear(hidden_dim, hidden_dim * 4)
        self.down_proj = nn.Linear(hidden_dim * 4, hidden_dim)

        # 激活函数
        self.act_fn = nn.GELU()

        # dropout
        self.ffn_dropout = nn.Dropout(attention_dropout)
        self.ffn_ln = nn.LayerNorm(hidden_dim, eps = 1e-12)


    def attention_Layer(self, query, key, value, attention_mask = None):
        # output shape: [batch_size, seq_len, hidden_dim]
        # Q, K, V shape: [batch_size, head_num, seq_len, head_dim]
        key = key.transpose(2, 3)
        attention_weight = query @ key / math.sqrt(self.head_dim)

        # 自带的下三角矩阵以及attention_mask
        if attention_mask is not None:
            attention_mask = attention_mask.tril()
            attention_weight = attention_weight.masked_fill(
                attention_mask == 0,
                float("-1e20")
            )
        else:
            attention_mask = torch.ones_like(attention_weight).tril()
            attention_weight = attention_weight.masked_fill(
                attention_mask == 0,
                float("-1e20")
            )
        attention_weight =torch.softmax(attention_weight, dim = -1)
        attention_weight = self.att_dropout(attention_weight)

        out_mid = attention_weight @ value
        # [batch_size, head_num, seq_len, head_dim] 
        #              -> [batch_size, seq_len, hidden_dim]
        out_mid = out_mid.transpose(1, 2).contiguous()
        batch_size, seq_len, _, _ = out_mid.size()
        out_mid = out_mid.view(batch_size, seq_len, -1)

        out = self.out_proj(out_mid)
        return out
        

    def MHA(self, x, attention_mask = None):
        # x shape: [batch_size, seq_len, hidden_dim]
        batch_size, seq_len, _ = x.size()

        # Q, K, V shape: [batch_size, seq_len, hidden_dim]
        Q = self.q_proj(x)
        K = self.k_proj(x)
        V = self.v_proj(x)

        # [batch_size, seq_len, hidden_dim] -> [batch_size, head_num, seq_len, head_dim]
        # hidden_dim -> head_num * head_dim
        Q_state = Q.view(batch_size, seq_len, self.head_num, -1).transpose(1, 2)
        K_state = K.view(batch_size, seq_len, self.head_num, -1).transpose(1, 2)
        V_state = V.view(batch_size, seq_len, self.head_num, -1).transpose(1, 2)

        output = self.attention_Layer(Q_state, K_state, V_state, attention_mask)    
        # [batch_size, head_num, seq_len, head_dim] 
        #       -> [batch_size, seq_len, hidden_dim]
        return self.att_ln(x + output)


    def FFN(self, x):
        # ffn(升维 -> 降维 -> att_ln)
        up = self.up_proj(x)
        act_up = self.act_fn(up)
        down = self.down_proj(act_up)
        drop_down = self.ffn_dropout(down)
        # post LayerNorm
        x = self.ffn_ln(x + drop_down)
        return x


    def forward(self, x, attention_mask = None):
        x = self.MHA(x, attention_mask)
        x = self.FFN(x)
        return x


class SeedLM(nn.Module):
    """Seed 004's Decoder: embedding -> layers -> output projection, sizes as arguments."""

    def __init__(self, vocab: int, hidden_dim: int, head_num: int, num_layers: int,
                 dropout: float = 0.1):
        super().__init__()
        self.layer_list = nn.ModuleList(
            [SimpleDecoderLayer(hidden_dim, head_num, dropout) for _ in range(num_layers)])
        self.emb = nn.Embedding(vocab, hidden_dim)
        self.out = nn.Linear(hidden_dim, vocab)

    def forward(self, x, mask):
        x = self.emb(x)
        for layer in self.layer_list:
            x = layer(x, mask)
        return self.out(x)

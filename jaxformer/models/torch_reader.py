"""The weights of stock torch modules (`torch.nn.Transformer`'s layers, embeddings,
linears, norms) as jaxformer parameters: `TorchReader` reads each tensor into a float32
numpy array, checking its shape, and lays it out as jaxformer's kernels;
`verify_structure` checks a converted tree against the one the model builds.
`jaxformer.models.torch_modules` reads the configuration and calls these."""

from __future__ import annotations

import jax
import numpy as np

from jaxformer.config import TransformerConfig



class TorchReader:
    """Reads torch tensors into float32 numpy arrays, checking every shape."""

    def __init__(self, config: TransformerConfig):
        self.c = config

    @staticmethod
    def array(tensor, shape: tuple[int, ...], name: str) -> np.ndarray:
        if tensor is None:
            raise ValueError(f"{name} is missing")
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
        if not tensor.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {tensor.dtype}")
        return tensor.detach().cpu().float().numpy().copy()

    def optional(self, tensor, shape: tuple[int, ...], name: str, fill: float) -> np.ndarray:
        """A bias or LayerNorm weight that torch may omit (bias=False): the neutral value."""
        if tensor is None:
            return np.full(shape, fill, np.float32)
        return self.array(tensor, shape, name)

    def attention(self, mha, name: str) -> dict:
        """in_proj (3D, D) -> query/key/value (D, H, K); out_proj (D, D) -> out (H, K, D)."""
        D, H, K = self.c.d_model, self.c.num_heads, self.c.head_dim
        w_3DD = self.array(mha.in_proj_weight, (3 * D, D), f"{name}.in_proj_weight")
        b_3D = self.optional(mha.in_proj_bias, (3 * D,), f"{name}.in_proj_bias", 0.0)
        params = {}
        for i, part in enumerate(("query", "key", "value")):
            # torch computes x @ W.T with W (out=H*K, in=D); our kernel is (in, H, K).
            params[part] = {"kernel": w_3DD[i * D:(i + 1) * D].T.reshape(D, H, K)}
            if self.c.attention_bias:
                params[part]["bias"] = b_3D[i * D:(i + 1) * D].reshape(H, K)
        w_out = self.array(mha.out_proj.weight, (D, D), f"{name}.out_proj.weight")
        params["out"] = {"kernel": w_out.T.reshape(H, K, D)}
        if self.c.attention_bias:
            params["out"]["bias"] = self.optional(mha.out_proj.bias, (D,),
                                                  f"{name}.out_proj.bias", 0.0)
        return params

    def dense(self, linear, d_in: int, d_out: int, name: str) -> dict:
        return {"kernel": self.array(linear.weight, (d_out, d_in), f"{name}.weight").T,
                "bias": self.optional(linear.bias, (d_out,), f"{name}.bias", 0.0)}

    def layer_norm(self, norm, name: str) -> dict:
        D = self.c.d_model
        if tuple(norm.normalized_shape) != (D,):
            raise ValueError(f"{name} normalizes shape {tuple(norm.normalized_shape)}, "
                             f"expected ({D},)")
        return {"scale": self.optional(norm.weight, (D,), f"{name}.weight", 1.0),
                "bias": self.optional(norm.bias, (D,), f"{name}.bias", 0.0)}

    def ffn(self, layer, name: str) -> dict:
        D, F = self.c.d_model, self.c.d_ff
        return {"wi": self.dense(layer.linear1, D, F, f"{name}.linear1"),
                "wo": self.dense(layer.linear2, F, D, f"{name}.linear2")}

    def encoder_layer(self, layer, name: str) -> dict:
        """TransformerEncoderLayer -> EncoderLayer (or a decoder layer without cross-attention)."""
        return {"self_attn": self.attention(layer.self_attn, f"{name}.self_attn"),
                "self_attn_norm": self.layer_norm(layer.norm1, f"{name}.norm1"),
                "ffn": self.ffn(layer, name),
                "ffn_norm": self.layer_norm(layer.norm2, f"{name}.norm2")}

    def decoder_layer(self, layer, name: str) -> dict:
        return {"self_attn": self.attention(layer.self_attn, f"{name}.self_attn"),
                "self_attn_norm": self.layer_norm(layer.norm1, f"{name}.norm1"),
                "cross_attn": self.attention(layer.multihead_attn, f"{name}.multihead_attn"),
                "cross_attn_norm": self.layer_norm(layer.norm2, f"{name}.norm2"),
                "ffn": self.ffn(layer, name),
                "ffn_norm": self.layer_norm(layer.norm3, f"{name}.norm3")}

    def embedding(self, embedding, vocab: int, name: str) -> dict:
        return {"embedding": self.array(embedding.weight, (vocab, self.c.d_model),
                                        f"{name}.weight")}

    def positions(self, table, name: str) -> dict:
        weight = getattr(table, "weight", table)
        if weight.ndim != 2 or weight.shape[0] < self.c.max_len:
            raise ValueError(f"{name} has shape {tuple(weight.shape)}, expected at least "
                             f"({self.c.max_len}, {self.c.d_model}) (max_len rows)")
        return {"embedding": self.array(weight[: self.c.max_len],
                                        (self.c.max_len, self.c.d_model), name)}


def verify_structure(params: dict, model, *init_args) -> None:
    """The converted tree must be exactly the tree `model.init` builds (names and shapes)."""
    expected = jax.eval_shape(model.init, jax.random.PRNGKey(0), *init_args)["params"]
    want = {jax.tree_util.keystr(p): x.shape
            for p, x in jax.tree_util.tree_leaves_with_path(expected)}
    got = {jax.tree_util.keystr(p): x.shape
           for p, x in jax.tree_util.tree_leaves_with_path(params)}
    if want != got:
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want))
        wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
        raise RuntimeError(f"converted parameters do not match {type(model).__name__}'s "
                           f"(a jaxformer bug): missing {missing}, unexpected {extra}, "
                           f"wrong shapes {wrong}")

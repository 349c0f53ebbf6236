"""jaxformer.interop: weights from PyTorch give PyTorch's logits.

The reference is written here in torch, independently of jaxformer: token
embedding * sqrt(d) + seed 001's sinusoidal table (computed in torch, not by
`jaxformer.sinusoidal_table`) -> torch.nn.Transformer with causal and key
padding masks -> Linear. Dropout 0, eval mode, float32; logits must agree to
1e-5. Sources and targets are right-padded, and no query row is fully masked
(torch returns NaN for those; jaxformer's finite answer is tested elsewhere).
"""

import functools
import math
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf

torch = pytest.importorskip("torch")
from jaxformer.models import from_torch_decoder_only, from_torch_transformer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # torch nested-tensor notes

PAD = 0
MAX_LEN = 16


def torch_sinusoids(length: int, d_model: int) -> "torch.Tensor":
    """Seed 001's PositionalEncoding table, in torch (odd d: one more sine than cosine)."""
    pe = torch.zeros(length, d_model)
    position = torch.arange(0, length, dtype=torch.float).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term[: d_model // 2])
    return pe


def right_padded(seed: int, lengths: list[int], width: int, vocab: int,
                 first: int | None = None) -> np.ndarray:
    """(B, width) ids in [3, vocab), row b real up to lengths[b], then PAD."""
    ids = np.random.default_rng(seed).integers(3, vocab, (len(lengths), width))
    if first is not None:
        ids[:, 0] = first
    for b, n in enumerate(lengths):
        ids[b, n:] = PAD
    return ids


def embed(embedding, ids, d_model, scale, pos_table):
    x = embedding(torch.as_tensor(ids))
    if scale:
        x = x * math.sqrt(d_model)
    return x + pos_table[: ids.shape[1]]


def torch_seq2seq_logits(tr, src_emb, tgt_emb, out, src, tgt, *, scale=True,
                         src_pos=None, tgt_pos=None):
    """Reference logits (B, T, V) of the torch model, whatever `tr.batch_first` is."""
    D = tr.d_model
    x = embed(src_emb, src, D, scale, torch_sinusoids(MAX_LEN, D) if src_pos is None
              else src_pos.weight)
    y = embed(tgt_emb, tgt, D, scale, torch_sinusoids(MAX_LEN, D) if tgt_pos is None
              else tgt_pos.weight)
    T = tgt.shape[1]
    causal = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)  # True = blocked
    src_pad = torch.as_tensor(src == PAD)
    tgt_pad = torch.as_tensor(tgt == PAD)
    if not tr.batch_first:  # torch's default layout is (length, batch, d)
        x, y = x.transpose(0, 1), y.transpose(0, 1)
    h = tr(x, y, tgt_mask=causal, src_key_padding_mask=src_pad,
           tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad)
    if not tr.batch_first:
        h = h.transpose(0, 1)
    return out(h).detach().numpy()


# name -> (torch.nn.Transformer kwargs, options of the surrounding model)
SEQ2SEQ_CASES = {
    "post_relu": (dict(d_model=48, nhead=4), {}),
    "pre_relu": (dict(d_model=48, nhead=4, norm_first=True), {}),
    "post_gelu": (dict(d_model=48, nhead=4, activation="gelu"), {}),
    "pre_gelu": (dict(d_model=48, nhead=4, activation="gelu", norm_first=True), {}),
    "d60_h6_seq_first": (dict(d_model=60, nhead=6, batch_first=False), {}),
    "d60_h6_pre_gelu_function": (
        dict(d_model=60, nhead=6, norm_first=True, activation=torch.nn.functional.gelu), {}),
    "no_bias_pre": (dict(d_model=48, nhead=4, bias=False, norm_first=True), {}),
    "eps1e-6_3enc_1dec": (dict(d_model=48, nhead=4, layer_norm_eps=1e-6,
                               num_encoder_layers=3, num_decoder_layers=1), {}),
    "unscaled_embeddings": (dict(d_model=48, nhead=4), {"scale": False}),
    "learned_positions": (dict(d_model=48, nhead=4), {"learned": True}),
    "tied_output": (dict(d_model=48, nhead=4), {"tie": True}),
    "shared_and_tied": (dict(d_model=48, nhead=4, norm_first=True), {"tie": True, "share": True}),
}


def make_embedding(vocab: int, d_model: int) -> "torch.nn.Embedding":
    """std d^-1/2, so that scaled embeddings and tied logits are O(1) (as jaxformer's init)."""
    emb = torch.nn.Embedding(vocab, d_model)
    torch.nn.init.normal_(emb.weight, std=d_model ** -0.5)
    return emb


def perturb_vectors(module):
    """torch inits every LayerNorm to (1, 0) and biases to 0: make them all different,
    so that a bias or norm mapped to the wrong place changes the logits."""
    with torch.no_grad():
        for p in module.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))


def build_seq2seq(kwargs, options, seed=0):
    torch.manual_seed(seed)
    kwargs = dict(dict(num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=80,
                       dropout=0.0, batch_first=True), **kwargs)
    tr = torch.nn.Transformer(**kwargs).eval()
    perturb_vectors(tr)
    D = kwargs["d_model"]
    src_vocab, tgt_vocab = (13, 13) if options.get("share") else (13, 11)
    src_emb = make_embedding(src_vocab, D)
    tgt_emb = src_emb if options.get("share") else make_embedding(tgt_vocab, D)
    out = torch.nn.Linear(D, tgt_vocab, bias=not options.get("tie"))
    if options.get("tie"):
        out.weight = tgt_emb.weight
    pos = {}
    if options.get("learned"):
        pos = dict(src_pos=torch.nn.Embedding(MAX_LEN, D), tgt_pos=torch.nn.Embedding(MAX_LEN, D))
    return tr, src_emb, tgt_emb, out, pos


def convert(tr, src_emb, tgt_emb, out, pos, options):
    extra = {}
    if pos:
        extra = dict(positions="learned", src_position_embedding=pos["src_pos"],
                     tgt_position_embedding=pos["tgt_pos"])
    return from_torch_transformer(tr, src_emb, tgt_emb, out, max_len=MAX_LEN,
                                  scale_embeddings=options.get("scale", True), **extra)


@pytest.mark.parametrize("case", list(SEQ2SEQ_CASES))
def test_transformer_logits_equal_torch(case):
    kwargs, options = SEQ2SEQ_CASES[case]
    tr, src_emb, tgt_emb, out, pos = build_seq2seq(kwargs, options)
    config, params = convert(tr, src_emb, tgt_emb, out, pos, options)

    src = right_padded(1, [7, 4, 1], 7, src_emb.num_embeddings)
    tgt = right_padded(2, [5, 3, 1], 5, tgt_emb.num_embeddings, first=1)  # BOS first
    want = torch_seq2seq_logits(tr, src_emb, tgt_emb, out, src, tgt,
                                scale=options.get("scale", True), **pos)
    got = jf.Transformer(config).apply({"params": params}, jnp.asarray(src), jnp.asarray(tgt))
    assert np.isfinite(want).all()
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)


def test_transformer_equals_torch_inference_fast_path():
    """torch's eval fast path (no_grad, nested tensors) gives the same logits too."""
    tr, src_emb, tgt_emb, out, pos = build_seq2seq(dict(d_model=48, nhead=4), {})
    config, params = convert(tr, src_emb, tgt_emb, out, pos, {})
    src = right_padded(3, [7, 2, 5], 7, 13)  # shapes as above: reuses compiled ops
    tgt = right_padded(4, [5, 2, 4], 5, 11, first=1)
    with torch.inference_mode():
        want = torch_seq2seq_logits(tr, src_emb, tgt_emb, out, src, tgt)
    got = jf.Transformer(config).apply({"params": params}, jnp.asarray(src), jnp.asarray(tgt))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["post_relu", "pre_gelu", "no_bias_pre", "learned_positions",
                                  "shared_and_tied", "eps1e-6_3enc_1dec"])
def test_converted_tree_is_exactly_the_init_tree(case):
    kwargs, options = SEQ2SEQ_CASES[case]
    config, params = convert(*build_seq2seq(kwargs, options), options)
    src = jnp.ones((1, 3), jnp.int32)
    # eval_shape: the tree init builds, without spending time computing it.
    init = jax.eval_shape(jf.Transformer(config).init, jax.random.PRNGKey(0), src, src)["params"]
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(init)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(
        lambda a, b: a.shape == b.shape and a.dtype == b.dtype == jnp.float32, params, init))


def test_config_is_read_from_the_torch_modules():
    tr = torch.nn.Transformer(d_model=60, nhead=6, num_encoder_layers=3, num_decoder_layers=1,
                              dim_feedforward=70, dropout=0.25, activation="gelu",
                              layer_norm_eps=1e-6, norm_first=True, bias=False)
    src_emb, tgt_emb = torch.nn.Embedding(21, 60), torch.nn.Embedding(17, 60)
    config, _ = from_torch_transformer(tr, src_emb, tgt_emb, torch.nn.Linear(60, 17),
                                       max_len=40, pad_id=3, bos_id=4, eos_id=5)
    assert (config.d_model, config.num_heads, config.d_ff) == (60, 6, 70)
    assert (config.num_encoder_layers, config.num_decoder_layers) == (3, 1)
    assert (config.src_vocab_size, config.tgt_vocab_size, config.max_len) == (21, 17, 40)
    assert (config.norm, config.activation, config.layer_norm_epsilon) == ("pre", "gelu", 1e-6)
    assert config.final_norm is True and config.attention_bias is False
    assert (config.attention_dropout, config.residual_dropout, config.ffn_dropout) == (
        0.25, 0.25, 0.25)
    assert not config.tie_output_embedding and not config.share_embeddings
    assert (config.pad_id, config.bos_id, config.eos_id) == (3, 4, 5)


def test_tie_and_share_are_detected_only_when_the_tensor_is_the_same():
    D = 16
    emb = torch.nn.Embedding(10, D)
    tr = torch.nn.Transformer(D, 2, 1, 1, 32, dropout=0.0)
    tied = torch.nn.Linear(D, 10, bias=False)
    tied.weight = emb.weight
    config, params = from_torch_transformer(tr, emb, emb, tied, max_len=8)
    assert config.tie_output_embedding and config.share_embeddings
    assert "tgt_embed" not in params and "out_proj" not in params["decoder"]
    # Equal values but separate tensors: not tied, not shared.
    copy = torch.nn.Embedding(10, D)
    copy.weight.data.copy_(emb.weight.data)
    untied = torch.nn.Linear(D, 10, bias=False)
    untied.weight.data.copy_(emb.weight.data)
    config, params = from_torch_transformer(tr, emb, copy, untied, max_len=8)
    assert not config.tie_output_embedding and not config.share_embeddings
    np.testing.assert_array_equal(params["decoder"]["out_proj"]["bias"], np.zeros(10))


# ----------------------------------------------------------------------------
# Decoder-only: torch.nn.TransformerEncoder + causal mask is a causal LM.
# ----------------------------------------------------------------------------

LM_CASES = {
    "post_relu_final_norm": dict(norm_first=False, activation="relu", final_norm=True),
    "pre_gelu_final_norm": dict(norm_first=True, activation="gelu", final_norm=True),
    "gelu_tanh_module": dict(norm_first=False, activation=torch.nn.GELU(approximate="tanh"),
                             final_norm=True),
    "post_gelu_no_final_norm": dict(norm_first=False, activation="gelu", final_norm=False),
    "pre_relu_tied_d60_h6": dict(norm_first=True, activation="relu", final_norm=True,
                                 tie=True, d_model=60, nhead=6),
    "learned_positions_seq_first": dict(norm_first=False, activation="relu", final_norm=True,
                                        learned=True, batch_first=False),
}


@pytest.mark.parametrize("case", list(LM_CASES))
def test_decoder_only_logits_equal_torch(case):
    opt = LM_CASES[case]
    torch.manual_seed(0)
    D, V = opt.get("d_model", 48), 14
    batch_first = opt.get("batch_first", True)
    layer = torch.nn.TransformerEncoderLayer(D, opt.get("nhead", 4), 72, dropout=0.0,
                                             activation=opt["activation"],
                                             norm_first=opt["norm_first"],
                                             batch_first=batch_first)
    norm = torch.nn.LayerNorm(D) if opt["final_norm"] else None
    encoder = torch.nn.TransformerEncoder(layer, 2, norm=norm, enable_nested_tensor=False).eval()
    perturb_vectors(encoder)
    emb = make_embedding(V, D)
    out = torch.nn.Linear(D, V, bias=not opt.get("tie"))
    if opt.get("tie"):
        out.weight = emb.weight
    pos_emb = torch.nn.Embedding(MAX_LEN, D) if opt.get("learned") else None
    config, params = from_torch_decoder_only(
        encoder, emb, out, max_len=MAX_LEN, positions="learned" if pos_emb else "sinusoidal",
        position_embedding=pos_emb)
    assert config.num_encoder_layers == 0 and config.use_final_norm == opt["final_norm"]
    assert config.tie_output_embedding == bool(opt.get("tie"))

    tokens = right_padded(5, [8, 5, 1], 8, V, first=1)
    T = tokens.shape[1]
    x = embed(emb, tokens, D, True, torch_sinusoids(MAX_LEN, D) if pos_emb is None
              else pos_emb.weight)
    causal = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    if not batch_first:
        x = x.transpose(0, 1)
    h = encoder(x, mask=causal, src_key_padding_mask=torch.as_tensor(tokens == PAD))
    if not batch_first:
        h = h.transpose(0, 1)
    want = out(h).detach().numpy()

    model = jf.DecoderOnlyLM(config)
    got = model.apply({"params": params}, jnp.asarray(tokens))
    init = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.asarray(tokens))["params"]
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(init)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------
# What cannot be read is refused, with the reason.
# ----------------------------------------------------------------------------


def small_parts(D=16, V=10, **kwargs):
    tr = torch.nn.Transformer(D, 2, 1, 1, 32, dropout=0.0, **kwargs)
    return tr, torch.nn.Embedding(V, D), torch.nn.Embedding(V, D), torch.nn.Linear(D, V)


class Identity(torch.nn.Module):
    def forward(self, x, *args, **kwargs):
        return x


class MyEncoderLayer(torch.nn.TransformerEncoderLayer):
    pass


def test_refuses_custom_encoder_and_decoder():
    _, se, te, out = small_parts()
    with pytest.raises(TypeError, match="transformer.encoder.*custom encoder"):
        from_torch_transformer(torch.nn.Transformer(16, 2, 1, 1, 32, custom_encoder=Identity()),
                               se, te, out, max_len=8)
    with pytest.raises(TypeError, match="transformer.decoder.*custom decoder"):
        from_torch_transformer(torch.nn.Transformer(16, 2, 1, 1, 32, custom_decoder=Identity()),
                               se, te, out, max_len=8)
    tr = small_parts()[0]
    tr.encoder.layers[0] = MyEncoderLayer(16, 2, 32)
    with pytest.raises(TypeError, match=r"encoder.layers\[0\].*TransformerEncoderLayer"):
        from_torch_transformer(tr, se, te, out, max_len=8)
    with pytest.raises(TypeError, match="transformer must be a torch.nn.Transformer"):
        from_torch_transformer(torch.nn.Linear(2, 2), se, te, out, max_len=8)


def test_refuses_other_activations():
    tr, se, te, out = small_parts(activation=torch.nn.functional.silu)
    with pytest.raises(ValueError, match="activation.*relu and gelu"):
        from_torch_transformer(tr, se, te, out, max_len=8)


def test_refuses_module_activation_that_torch_decoder_drops():
    """A torch quirk: nn.Transformer(activation=nn.GELU()) deep-copies its decoder
    layer, whose __setstate__ then sets `activation = F.relu`: the encoder runs
    GELU, the decoder ReLU. One config activation cannot express that."""
    tr, se, te, out = small_parts(activation=torch.nn.GELU())
    assert isinstance(tr.encoder.layers[0].activation, torch.nn.GELU)
    assert tr.decoder.layers[0].activation is torch.nn.functional.relu
    with pytest.raises(ValueError, match="disagree on activation"):
        from_torch_transformer(tr, se, te, out, max_len=8)


def test_refuses_layers_that_disagree():
    tr, se, te, out = small_parts()
    tr.decoder.layers[0].norm_first = True  # encoder stays post-norm
    with pytest.raises(ValueError, match="norm_first"):
        from_torch_transformer(tr, se, te, out, max_len=8)


@pytest.mark.parametrize("tensor", ["linear1.weight", "in_proj_bias", "norm2.bias"])
def test_refuses_a_tensor_of_unexpected_shape(tensor):
    tr, se, te, out = small_parts()
    layer = tr.encoder.layers[0]
    if tensor == "linear1.weight":
        layer.linear1.weight = torch.nn.Parameter(torch.zeros(32, 17))
    elif tensor == "in_proj_bias":
        layer.self_attn.in_proj_bias = torch.nn.Parameter(torch.zeros(47))
    else:
        layer.norm2.bias = torch.nn.Parameter(torch.zeros(15))
    with pytest.raises(ValueError, match=rf"encoder.layers\[0\].*{tensor}.*shape"):
        from_torch_transformer(tr, se, te, out, max_len=8)


def test_refuses_mismatched_embeddings_and_output():
    tr, se, te, out = small_parts()
    with pytest.raises(ValueError, match="tgt_embedding has embedding_dim 8"):
        from_torch_transformer(tr, se, torch.nn.Embedding(10, 8), out, max_len=8)
    with pytest.raises(ValueError, match="output_projection.weight must be"):
        from_torch_transformer(tr, se, te, torch.nn.Linear(16, 11), max_len=8)
    tied = torch.nn.Linear(16, 10)
    tied.weight = te.weight
    with torch.no_grad():
        tied.bias.fill_(0.5)
    with pytest.raises(ValueError, match="tied.*non-zero bias"):
        from_torch_transformer(tr, se, te, tied, max_len=8)


def test_refuses_inconsistent_position_arguments():
    tr, se, te, out = small_parts()
    with pytest.raises(ValueError, match="needs src_position_embedding"):
        from_torch_transformer(tr, se, te, out, max_len=8, positions="learned")
    with pytest.raises(ValueError, match="positions must be"):
        from_torch_transformer(tr, se, te, out, max_len=8, positions="rotary")
    short = torch.nn.Embedding(4, 16)
    with pytest.raises(ValueError, match="at least"):
        from_torch_transformer(tr, se, te, out, max_len=8, positions="learned",
                               src_position_embedding=short, tgt_position_embedding=short)


def test_missing_torch_gives_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'jaxformer\[torch\]'"):
        from_torch_transformer(None, None, None, None, max_len=8)


def test_jaxformer_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import jaxformer, jaxformer.interop\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n")
    repo = pathlib.Path(__file__).resolve().parents[2]  # finds jaxformer even if not installed
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600, cwd=repo)


# ----------------------------------------------------------------------------
# scan_layers=True: the same torch weights, stacked, give the unrolled logits.
# ----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def _logits(model, params, *inputs):
    return model.apply({"params": params}, *inputs)


def test_scanned_import_gives_the_unrolled_logits():
    """PyTorch import into a scanned model (stacked layers) and into the unrolled
    model: the same logits (<= 1e-6 relative). Both norms: the encoder-decoder
    Post-LN, the decoder-only LM Pre-LN (torch agreement itself is tested above)."""
    kwargs, options = dict(d_model=48, nhead=4, norm_first=False,
                           num_encoder_layers=3, num_decoder_layers=2), {}
    tr, src_emb, tgt_emb, out, pos = build_seq2seq(kwargs, options)
    config, params = convert(tr, src_emb, tgt_emb, out, pos, options)
    scanned_config, stacked = from_torch_transformer(tr, src_emb, tgt_emb, out, max_len=MAX_LEN,
                                                     scan_layers=True)
    assert scanned_config == config.replace(scan_layers=True)
    assert "layers" in stacked["encoder"] and "layers_0" not in stacked["encoder"]
    assert stacked["encoder"]["layers"]["ffn"]["wi"]["kernel"].shape == (3, 48, 80)
    src = right_padded(1, [7, 4, 1], 7, src_emb.num_embeddings)
    tgt = right_padded(2, [5, 3, 1], 5, tgt_emb.num_embeddings, first=1)
    want = np.asarray(_logits(jf.Transformer(config), params, src, tgt))
    got = np.asarray(_logits(jf.Transformer(scanned_config), stacked, src, tgt))
    assert np.linalg.norm(got - want) <= 1e-6 * np.linalg.norm(want)

    # decoder-only: a causal TransformerEncoder LM
    torch.manual_seed(1)
    layer = torch.nn.TransformerEncoderLayer(48, 4, 72, dropout=0.0, norm_first=True,
                                             batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 3, norm=torch.nn.LayerNorm(48),
                                          enable_nested_tensor=False).eval()
    perturb_vectors(encoder)
    emb, lm_out = make_embedding(14, 48), torch.nn.Linear(48, 14)
    lm_config, lm_params = from_torch_decoder_only(encoder, emb, lm_out, max_len=MAX_LEN)
    lm_scanned, lm_stacked = from_torch_decoder_only(encoder, emb, lm_out, max_len=MAX_LEN,
                                                     scan_layers=True)
    assert lm_scanned.scan_layers and lm_stacked["decoder"]["layers"]["ffn"]["wo"][
        "kernel"].shape == (3, 72, 48)
    tokens = right_padded(5, [8, 5, 1], 8, 14, first=1)
    want = np.asarray(_logits(jf.DecoderOnlyLM(lm_config), lm_params, tokens))
    got = np.asarray(_logits(jf.DecoderOnlyLM(lm_scanned), lm_stacked, tokens))
    assert np.linalg.norm(got - want) <= 1e-6 * np.linalg.norm(want)

"""The encoder-decoder families' tensor tables (Whisper and Marian, Hugging Face
directories): the one place that names their tensors. `jaxformer.models.hf_encdec`
checks and reads a directory by looping over them (`jaxformer.models.tensor_table`).

A family is two tables, the encoder stack (with the family's top rows) and the
decoder stack (`tables`). Dimension letters: D model width, H heads, K head dim,
F feed-forward width, V vocabulary, C mel bins, S / T encoder / decoder positions
(Whisper). Per layer i the names are behind "{encoder,decoder}/layers_{i}/" and
"model.{encoder,decoder}.layers.{i}.". No GGUF form (`gguf` None).

Not here: Marian's sinusoid tables (computed, `hf_encdec.marian_positions`; the
copies a file may carry are ignored), Whisper's CTranslate2 names
(`whisper.config.map_ct2`: fused [q; k; v] projections, not one row per tensor).
"""

from __future__ import annotations

from jaxformer.models.tensor_table import (CONV, EMBEDDING, HEAD_BIAS, HEADS_IN, HEADS_OUT,
                                           LINEAR, NORM, ROW, VECTOR, Table, Tensor)

WHISPER, MARIAN = "WhisperForConditionalGeneration", "MarianMTModel"
T = Tensor


def _bias(letter: str):
    def when(c) -> bool:
        return c.has_attention_bias(letter)
    return when


def _attention(ours: str, hf: str) -> tuple[Tensor, ...]:
    """An attention block's rows (`ours` / `hf`: its prefixes within the layer)."""
    rows = []
    for part, letter in (("query", "q"), ("key", "k"), ("value", "v")):
        rows += [T(f"{ours}/{part}/kernel", f"{hf}.{letter}_proj.weight", None, "HK,D",
                   HEADS_IN, "H"),
                 T(f"{ours}/{part}/bias", f"{hf}.{letter}_proj.bias", None, "HK", HEAD_BIAS,
                   "H", when=_bias(letter))]
    return (*rows, T(f"{ours}/out/kernel", f"{hf}.out_proj.weight", None, "D,HK", HEADS_OUT, "H"),
            T(f"{ours}/out/bias", f"{hf}.out_proj.bias", None, "D", VECTOR))


def _layer_norm(ours: str, hf: str) -> tuple[Tensor, ...]:
    return (T(f"{ours}/scale", f"{hf}.weight", None, "D", NORM),
            T(f"{ours}/bias", f"{hf}.bias", None, "D", VECTOR))


_FFN = (T("ffn/wi/kernel", "fc1.weight", None, "F,D", LINEAR),
        T("ffn/wi/bias", "fc1.bias", None, "F", VECTOR),
        T("ffn/wo/kernel", "fc2.weight", None, "D,F", LINEAR),
        T("ffn/wo/bias", "fc2.bias", None, "D", VECTOR),
        *_layer_norm("ffn_norm", "final_layer_norm"))

ENCODER_LAYER = (*_attention("self_attn", "self_attn"),
                 *_layer_norm("self_attn_norm", "self_attn_layer_norm"), *_FFN)
DECODER_LAYER = (*_attention("self_attn", "self_attn"),
                 *_layer_norm("self_attn_norm", "self_attn_layer_norm"),
                 *_attention("cross_attn", "encoder_attn"),
                 *_layer_norm("cross_attn_norm", "encoder_attn_layer_norm"), *_FFN)

TOP = {
    WHISPER: (
        T("stem/conv_0/kernel", "model.encoder.conv1.weight", None, "D,C,3", CONV),
        T("stem/conv_0/bias", "model.encoder.conv1.bias", None, "D", VECTOR),
        T("stem/conv_1/kernel", "model.encoder.conv2.weight", None, "D,D,3", CONV),
        T("stem/conv_1/bias", "model.encoder.conv2.bias", None, "D", VECTOR),
        T("encoder/positions/embedding", "model.encoder.embed_positions.weight", None, "S,D",
          EMBEDDING),
        T("decoder/positions/embedding", "model.decoder.embed_positions.weight", None, "T,D",
          EMBEDDING),
        T("tgt_embed/embedding", "model.decoder.embed_tokens.weight", None, "V,D", EMBEDDING),
        *_layer_norm("encoder/final_norm", "model.encoder.layer_norm"),
        *_layer_norm("decoder/final_norm", "model.decoder.layer_norm"),
    ),
    MARIAN: (  # one table shared by both embeddings and the tied output
        T("src_embed/embedding", "model.shared.weight", None, "V,D", EMBEDDING),
        T("decoder/logits_bias", "final_logits_bias", None, "1,V", ROW),
    ),
}

_TIED = ("proj_out.weight", "lm_head.weight")  # the tied output head
IGNORED = {  # tensors a checkpoint may carry that change nothing
    WHISPER: _TIED,
    MARIAN: (*_TIED, "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
             "model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight"),
}


def tables(arch: str, mel_bins: int = 0) -> tuple[Table, Table]:
    """(encoder table, decoder table) of `arch` (WHISPER or MARIAN); `mel_bins`: the
    feature count Whisper's first convolution reads (not in the config)."""
    if arch not in TOP:
        raise ValueError(f"no encoder-decoder tensor table for {arch!r} ({', '.join(TOP)})")

    def dims(c) -> dict:
        out = dict(D=c.d_model, H=c.num_heads, K=c.head_dim, F=c.d_ff, V=c.tgt_vocab_size)
        if arch == WHISPER:
            out.update(C=mel_bins, S=c.encoder_len, T=c.decoder_len)
        return out

    def stack(name: str, top: tuple, layer: tuple, layers) -> Table:
        return Table(top=top, layer=layer, dims=dims, layers=layers, prefixes={
            "ours": f"{name}/layers_{{i}}/", "hf": f"model.{name}.layers.{{i}}.", "gguf": ""})

    return (stack("encoder", TOP[arch], ENCODER_LAYER, lambda c: c.num_encoder_layers),
            stack("decoder", (), DECODER_LAYER, lambda c: c.num_decoder_layers))

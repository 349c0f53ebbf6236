"""The vocabulary stored in a GGUF file as a Hugging Face `tokenizers.Tokenizer`, tokenizing
as llama.cpp does: byte-level BPE ("gpt2") or SentencePiece ("llama")."""

from __future__ import annotations

from jaxformer.errors import FileFormatError
from jaxformer.interop.gguf import GGUFFile  # before gguf: its ImportError names the extra

import gguf  # noqa: E402,I001


def tokenizer_from_gguf(file: GGUFFile):
    """A `tokenizers.Tokenizer` from the vocabulary stored in a GGUF file (None: it has none).

    `tokenizer.ggml.model` "gpt2": byte-level BPE (tokens + merges); the
    pre-tokenizer follows llama.cpp: the GPT-2 regex, with digits split one by
    one for the pre-tokenizer types that do so (smollm, starcoder, ...).
    "llama": SentencePiece (`spm_tokenizer`). Control tokens (`<|im_start|>`,
    `<s>`, ...) are special tokens, matched whole; BOS/EOS are added as
    `tokenizer.ggml.add_bos_token` / `add_eos_token` say (llama.cpp's defaults:
    BOS for "llama", nothing for "gpt2").
    """
    import tokenizers  # noqa: PLC0415 - optional
    from tokenizers import decoders, models, pre_tokenizers  # noqa: PLC0415

    kind = file.metadata.get("tokenizer.ggml.model")
    if kind is None:
        return None
    if kind == "llama":
        return spm_tokenizer(file)
    if kind != "gpt2":
        raise ValueError(f"{file.path}: tokenizer model {kind!r} is not supported "
                         "(only 'gpt2' byte-level BPE and 'llama' SentencePiece)")
    tokens = file.metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in file.metadata["tokenizer.ggml.merges"]]
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False)
    tokenizer = tokenizers.Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if file.metadata.get("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact",
                                                  "command-r", "codeshell", "exaone"):
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    types = file.metadata.get("tokenizer.ggml.token_type", [])
    control = int(gguf.TokenType.CONTROL)
    tokenizer.add_special_tokens([tokenizers.AddedToken(t, special=True)
                                  for t, kind in zip(tokens, types) if kind == control])
    add_bos_eos(tokenizer, file, tokens, default_bos=False)
    return tokenizer


SPACE = "\u2581"  # SentencePiece's space marker "▁"


def spm_merges(tokens, scores, mergeable) -> list[tuple[str, str]]:
    """BPE merges that reproduce SentencePiece's (and llama.cpp's) encoding.

    SentencePiece merges, among adjacent symbols, the pair whose concatenation is
    the vocabulary piece of highest score (leftmost first). As BPE merges: every
    split (left, right) of a mergeable piece into two mergeable pieces, ranked by
    the merged piece's score, highest first (ties: lower id first).
    """
    ids = {t: i for i, t in enumerate(tokens) if mergeable[i]}
    merges = []
    for piece, i in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                merges.append((-float(scores[i]), i, ids[left], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def spm_tokenizer(file: GGUFFile):
    """The SentencePiece vocabulary of a GGUF file (`tokenizer.ggml.model == "llama"`)
    as llama.cpp tokenizes with it: spaces become "▁", a "▁" is prepended to the
    text (and after each special token) if `tokenizer.ggml.add_space_prefix`
    (default true), pieces merge by score (`spm_merges`), and characters outside
    the vocabulary fall back to their UTF-8 bytes as `<0xXX>` tokens."""
    import tokenizers  # noqa: PLC0415 - optional
    from tokenizers import decoders, models, normalizers  # noqa: PLC0415

    meta = file.metadata
    tokens = list(meta["tokenizer.ggml.tokens"])
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    T = gguf.TokenType
    types = meta.get("tokenizer.ggml.token_type") or [int(T.NORMAL)] * len(tokens)
    if not len(scores) == len(types) == len(tokens):
        raise FileFormatError(file.path, f"tokenizer.ggml.scores ({len(scores)}) / token_type "
                              f"({len(types)}) and tokens ({len(tokens)}) differ in length",
                              "the file is damaged: download it again")
    unknown = meta.get("tokenizer.ggml.unknown_token_id")
    if unknown is None:
        unknown = next((i for i, k in enumerate(types) if k == int(T.UNKNOWN)), None)
    bpe = models.BPE({t: i for i, t in enumerate(tokens)},
                     spm_merges(tokens, scores, [k == int(T.NORMAL) for k in types]),
                     unk_token=None if unknown is None else tokens[int(unknown)],
                     fuse_unk=True, byte_fallback=True)
    tokenizer = tokenizers.Tokenizer(bpe)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # A normalizer, not the Metaspace pre-tokenizer: that one prepends no "▁" to text that
    # starts with a space, SentencePiece and llama.cpp do (" a" -> "▁▁a").
    replace = normalizers.Replace(" ", SPACE)
    tokenizer.normalizer = (normalizers.Sequence([normalizers.Prepend(SPACE), replace])
                            if prefix else replace)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(
        steps + [decoders.Strip(" ", 1, 0)] if prefix else steps)
    special = (int(T.CONTROL), int(T.UNKNOWN))
    tokenizer.add_tokens([tokenizers.AddedToken(t, normalized=False, special=False)
                          for t, k in zip(tokens, types) if k == int(T.USER_DEFINED)])
    tokenizer.add_special_tokens([tokenizers.AddedToken(t, normalized=False, special=True)
                                  for t, k in zip(tokens, types) if k in special])
    add_bos_eos(tokenizer, file, tokens, default_bos=True)
    return tokenizer


def add_bos_eos(tokenizer, file: GGUFFile, tokens, *, default_bos: bool) -> None:
    """A post-processor adding BOS / EOS as the file's add_bos_token / add_eos_token say."""
    from tokenizers import processors  # noqa: PLC0415 - optional

    meta = file.metadata
    ends = {}
    for end, default in (("bos", default_bos), ("eos", False)):
        token_id = meta.get(f"tokenizer.ggml.{end}_token_id")
        if meta.get(f"tokenizer.ggml.add_{end}_token", default) and token_id is not None:
            ends[end] = (tokens[int(token_id)], int(token_id))
    if not ends:
        return
    bos = [ends["bos"][0]] if "bos" in ends else []
    eos = [ends["eos"][0]] if "eos" in ends else []
    tokenizer.post_processor = processors.TemplateProcessing(
        single=bos + ["$A"] + eos, pair=bos + ["$A"] + eos + bos + ["$B:1"] + eos,
        special_tokens=sorted(set(ends.values())))

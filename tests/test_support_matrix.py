"""The support matrix (docs/support.md): every decoder-only family `load` reads (tiny
random configs from config.json dicts, `tests.families`) by every decoding and serving
feature. Each cell either works, checked against greedy `generate` of each prompt alone
(prompts longer than the sliding window), or is refused with a ValueError naming the
feature and the reason, which the matrix records. `JAXFORMER_WRITE_SUPPORT=1` rewrites
docs/support.md; otherwise it must equal the matrix these tests find."""

import os
import re

import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.nn.lora import join, merge_lora, split_adapters
from jaxformer.nn.quant_params import quantize_params
from jaxformer.serve import Engine, Request, SamplingParams, speculative_generate
from jaxformer.serve.adapters import adapter_params
from tests.families import FAMILIES, NEW, VOCAB, WIDTH, alone, family_config

SUPPORT_MD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "docs", "support.md")
WRITE_COMMAND = "JAXFORMER_WRITE_SUPPORT=1 python -m pytest tests/test_support_matrix.py -n 0"
# Each feature, and what a refusal of it must name.
FEATURES = {
    "generate": r"generate",
    "beam": r"beam",
    "engine": r"[Ee]ngine|serv",
    "prefix cache": r"prefix",
    "n-gram speculation": r"speculati",
    "draft speculation": r"speculati",
    "int8 KV": r"kv_cache_quant|int8",
    "kept GGUF blocks": r"quant_layouts|block",
    "served LoRA": r"adapter|LoRA",
}
MAX_TOKENS = 8
# A GGUF file mixing block types, as the reader keeps them (`config.quant_layouts`): Q4_1
# kernels, Q8_0 value and down projections, a Q4_0 up projection (blocks of 32, so the
# 32-wide configs fit; K-quants' super-blocks of 256 are checked in tests/nn/test_kquant.py).
KEPT_BLOCKS = (("decoder/layers_0/self_attn/value", "int8_block"),
               ("decoder/layers_1/ffn/wo", "int8_block"),
               ("decoder/layers_0/ffn/wi", "int4_sym"))
ENGINE_ARGS = dict(slots=2, max_len=40, page_size=4, prefill_chunk=8)
# The cache and weight layouts' columns: one slot (two compiled programs, not four; the
# engine column has the slots) and each prompt in one prefill chunk. `generate`'s
# one-pass prefill attends to the prompt's keys before their int8 rounding, a chunked
# prefill to the earlier chunks' rounded keys: qwen2's first token here is a 0.003-logit
# near-tie that this flips.
LAYOUT_ENGINE_ARGS = dict(ENGINE_ARGS, slots=1, prefill_chunk=16)
ROWS: dict = {}  # family -> {feature: cell}, filled once per process


def matrix_prompts():
    """Three prompts longer than the window (the third repeats itself: drafts to accept),
    and a fourth sharing the first's two full pages (a prefix hit)."""
    rng = np.random.default_rng(5)
    shared = [int(t) for t in rng.integers(3, VOCAB, 8)]
    return ([shared + [7, 8, 9], [int(t) for t in rng.integers(3, VOCAB, 13)],
             [5, 6, 5, 6, 5, 6, 5]], shared + [10, 11])


def served(engine, requests):
    """Each request's generated tokens, the engine run until idle."""
    handles = [engine.submit(r) for r in requests]
    engine.run_until_idle()
    return [[e.token for e in h.result(0) if e.token is not None and not e.prompt]
            for h in handles]


def greedy(prompt, adapter=None):
    return Request(prompt, SamplingParams(max_tokens=MAX_TOKENS), adapter=adapter)


def check_generate(model, params, prompts):
    """Cached decoding: each new token is the full forward's argmax after the tokens
    before it (one forward compile: a fixed width)."""
    forward = jnp.zeros((len(prompts), WIDTH + NEW), jnp.int32)
    wanted = []
    for row, prompt in enumerate(prompts):
        tokens = alone(model, params, prompt, NEW)
        forward = forward.at[row, :len(prompt) + len(tokens) - 1].set(
            jnp.asarray(prompt + tokens[:-1], jnp.int32))
        wanted.append(tokens)
    logits = model.apply({"params": params}, forward, jf.causal_mask(WIDTH + NEW))
    for row, (prompt, tokens) in enumerate(zip(prompts, wanted)):
        picks = np.argmax(logits[row, len(prompt) - 1:len(prompt) - 1 + len(tokens)], -1)
        assert picks.tolist() == tokens
    assert len({tuple(w) for w in wanted}) == len(wanted)  # not a degenerate model


def check_beam(model, params, prompts):
    """Beam 1 is greedy decoding."""
    out = jf.beam_search(model, params, jnp.asarray([prompts[0]]), max_new_tokens=NEW,
                         beam_size=1)
    assert out.tokens[0].tolist()[:MAX_TOKENS] == alone(model, params, prompts[0], MAX_TOKENS)


def check_engine(model, params, prompts, engine_args=ENGINE_ARGS):
    """Three requests queued for the slots (two by default: chunked prefill, joins while
    others decode)."""
    engine = Engine(model, params, prefix_cache=False, **engine_args)
    assert served(engine, [greedy(p) for p in prompts]) == [
        alone(model, params, p, MAX_TOKENS) for p in prompts]


def check_prefix_cache(model, params, prompts, sharing):
    """The fourth prompt finds the first's pages."""
    engine = Engine(model, params, **ENGINE_ARGS)
    got = served(engine, [greedy(prompts[0])]) + served(engine, [greedy(sharing)])
    assert engine.metrics()["prefix_hit_rate"] > 0
    assert got == [alone(model, params, p, MAX_TOKENS) for p in (prompts[0], sharing)]


def check_ngram(model, params, prompts):
    engine = Engine(model, params, speculative=2, **ENGINE_ARGS)
    assert served(engine, [greedy(p) for p in prompts]) == [
        alone(model, params, p, MAX_TOKENS) for p in prompts]
    assert engine.metrics()["acceptance_rate"] > 0


def check_draft(model, params, prompts, draft):
    """`speculative_generate` with a draft model of the same family (other weights)."""
    rows = np.zeros((len(prompts), WIDTH), np.int32)
    for row, prompt in enumerate(prompts):
        rows[row, :len(prompt)] = prompt
    out = speculative_generate(model, params, jnp.asarray(rows), max_new_tokens=MAX_TOKENS,
                               k=2, draft=draft,
                               prompt_lengths=jnp.asarray([len(p) for p in prompts]))
    eos = model.config.eos_id
    got = [[int(t) for t in out.tokens[row][:int(out.lengths[row])]]
           for row in range(len(prompts))]
    assert [g[:g.index(eos)] if eos in g else g for g in got] == [
        alone(model, params, p, MAX_TOKENS) for p in prompts]


def check_int8_kv(config, params, prompts):
    """The int8 cache's engine equals `generate` of the same int8-KV config."""
    model = jf.DecoderOnlyLM(config.replace(kv_cache_quant="int8"))
    check_engine(model, params, prompts, LAYOUT_ENGINE_ARGS)


def check_kept_blocks(config, params, prompts):
    """Float weights quantized to a mix of GGUF block layouts, served as stored."""
    quantized, qparams = quantize_params(config, params, "int4", quant_layouts=KEPT_BLOCKS)
    check_engine(jf.DecoderOnlyLM(quantized), qparams, prompts, LAYOUT_ENGINE_ARGS)


def check_lora(model, params, prompts, lora_run):
    """A LoRA run served as an adapter: its requests are `generate` of the merged model,
    the base's beside them are the base's."""
    run_config, run_params = lora_run
    engine = Engine(model, params, adapters={"tuned": adapter_params(model, *lora_run)},
                    **ENGINE_ARGS)
    two = prompts[:2]
    got = served(engine, [greedy(p, "tuned") for p in two] + [greedy(p) for p in two])
    merged = merge_lora(run_config, run_params)[1]
    want = ([alone(model, merged, p, MAX_TOKENS) for p in two]
            + [alone(model, params, p, MAX_TOKENS) for p in two])
    assert got == want
    assert want[:2] != want[2:]  # the adapter changes the tokens


def cell(feature, check, *args):
    """"works" when `check(*args)` passes; "refused: <reason>" when it raises a
    ValueError naming the feature; any other failure fails the test."""
    try:
        check(*args)
    except ValueError as error:
        reason = str(error)
        assert re.search(FEATURES[feature], reason), f"{feature}: refused without naming it: " \
                                                     f"{reason}"
        return "refused: " + reason.replace("|", "/")
    return "works"


def support_row(family, make_lm):
    """{feature: cell} of one family (computed once per process)."""
    if family in ROWS:
        return ROWS[family]
    config = family_config(family)
    model, params = make_lm(config, seed=4)
    draft = make_lm(config, seed=7)
    lora_config = config.replace(lora_rank=2, lora_targets=("q", "v", "down"))
    adapters = split_adapters(make_lm(lora_config, seed=9)[1])[0]
    prompts, sharing = matrix_prompts()
    ROWS[family] = {
        "generate": cell("generate", check_generate, model, params, prompts),
        "beam": cell("beam", check_beam, model, params, prompts),
        "engine": cell("engine", check_engine, model, params, prompts),
        "prefix cache": cell("prefix cache", check_prefix_cache, model, params, prompts,
                             sharing),
        "n-gram speculation": cell("n-gram speculation", check_ngram, model, params, prompts),
        "draft speculation": cell("draft speculation", check_draft, model, params, prompts,
                                  draft),
        "int8 KV": cell("int8 KV", check_int8_kv, config, params, prompts),
        "kept GGUF blocks": cell("kept GGUF blocks", check_kept_blocks, config, params,
                                 prompts),
        "served LoRA": cell("served LoRA", check_lora, model, params, prompts,
                            (lora_config, join(adapters, params))),
    }
    return ROWS[family]


def support_markdown(rows):
    """docs/support.md: the matrix as a plain Markdown table."""
    lines = [
        "# Support matrix",
        "",
        "Every decoder-only family `jf.load` reads, by every decoding and serving feature, "
        "as `tests/test_support_matrix.py` finds it on tiny random configs (built from "
        "config.json dicts, sliding windows of 5 tokens, prompts longer than the window). "
        "\"works\": greedy tokens equal `generate`'s of each prompt alone (for `generate` "
        "itself: the full forward's argmax after each token); \"refused\": a ValueError "
        "naming the feature, with the reason quoted.",
        "",
        "Columns: `generate` (cached decoding); beam (`jf.beam_search`, beam 1); engine "
        "(`Engine`, two slots for three requests); prefix cache (a hit); n-gram speculation "
        "(`Engine(speculative=2)`, prompt lookup); draft speculation "
        "(`speculative_generate(draft=...)`, a draft model of the same family); int8 KV "
        "(`kv_cache_quant=\"int8\"`, served, against `generate` of the int8-KV model); kept "
        "GGUF blocks (a Q4_1 / Q8_0 / Q4_0 mix of per-kernel layouts, `quant_layouts`, "
        "served as stored, against `generate` of the same); served LoRA "
        "(`Engine(adapters=...)` of a LoRA run, against `generate` of the merged model).",
        "",
        f"Regenerate with `{WRITE_COMMAND}`.",
        "",
        "| family | " + " | ".join(FEATURES) + " |",
        "|---|" + "---|" * len(FEATURES),
    ]
    for family in sorted(rows):
        lines.append(f"| {family} | " + " | ".join(rows[family][f] for f in FEATURES) + " |")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_feature_works_or_is_refused_by_name(make_lm, family):
    row = support_row(family, make_lm)
    assert set(row) == set(FEATURES)
    assert all(c == "works" or c.startswith("refused: ") for c in row.values()), row


def test_docs_support_md_is_the_matrix(make_lm):
    """Last in this file: the rows above are computed already."""
    text = support_markdown({f: support_row(f, make_lm) for f in FAMILIES})
    if os.environ.get("JAXFORMER_WRITE_SUPPORT") == "1":
        with open(SUPPORT_MD, "w") as f:
            f.write(text)
    with open(SUPPORT_MD) as f:
        committed = f.read()
    assert committed == text, f"docs/support.md is not the matrix found: run {WRITE_COMMAND}"

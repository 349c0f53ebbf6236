"""Structured output (issue 43 item 5): JSON-schema and regex constraints as token masks
over a real vocabulary; outputs checked by `json.loads`, `jsonschema` and `re`."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("outlines_core", reason="needs the `structured` extra")

from jaxformer.decode import cache as cache_lib  # noqa: E402
from jaxformer.serve.constraint import Grammars, token_bytes  # noqa: E402
from jaxformer.text import ByteTokenizer  # noqa: E402

SLOTS = 200  # one cache size for every run: one compiled step

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0},
                         "city": {"type": "string", "maxLength": 24}},
          "required": ["name", "age", "city"]}


def test_a_regex_over_bytes_masks_step_by_step():
    tokenizer = ByteTokenizer()
    grammars = Grammars(tokenizer, vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id)
    constraint = grammars.regex("ab+c")
    code = lambda ch: ord(ch) + 3  # noqa: E731
    assert np.flatnonzero(constraint.allowed()).tolist() == [code("a")]
    constraint.advance(code("a"))
    assert np.flatnonzero(constraint.allowed()).tolist() == [code("b")]
    constraint.advance(code("b"))
    assert np.flatnonzero(constraint.allowed()).tolist() == [code("b"), code("c")]
    assert not constraint.done()
    constraint.advance(code("c"))
    assert np.flatnonzero(constraint.allowed()).tolist() == [tokenizer.eos_id]
    assert constraint.done()
    with pytest.raises(ValueError, match="not allowed"):
        constraint.advance(code("a"))


def test_bad_grammars_are_one_clear_error():
    tokenizer = ByteTokenizer()
    grammars = Grammars(tokenizer, vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id)
    with pytest.raises(ValueError, match="regex"):
        grammars.regex("a(b")
    with pytest.raises(ValueError, match="not JSON"):
        grammars.json_schema("{type: object")
    with pytest.raises(ValueError, match="dict or JSON text"):
        grammars.json_schema(3)


@pytest.fixture(scope="module")
def smollm2_grammars(smollm2):
    model, _, tokenizer, _ = smollm2
    c = model.config
    return Grammars(tokenizer, vocab_size=c.tgt_vocab_size, eos_id=c.eos_id)


def test_smollm2_token_bytes_agree_with_the_tokenizers_decoder(smollm2):
    """Every token that is whole UTF-8 decodes (by `tokenizers`' ByteLevel decoder) to
    the bytes the grammar library is given."""
    _, _, tokenizer, _ = smollm2
    table = token_bytes(tokenizer)
    assert len(table) > 49_000
    checked = 0
    for index in range(0, len(table), 7):
        if index not in table:
            continue
        text = tokenizer.decode([index])
        if "\ufffd" not in text:
            assert table[index] == text.encode("utf-8"), index
            checked += 1
    assert checked > 6000


@pytest.fixture(scope="module")
def constrained_greedy(smollm2):
    """`run(prompt, constraint or None, n)` -> text: greedy decoding of SmolLM2 with the
    constraint's mask applied to the logits before each pick."""
    model, params, tokenizer, _ = smollm2
    c = model.config
    step = jax.jit(lambda p, cache, t: cache_lib.cached_forward(model, p, cache, t))

    def run(prompt, constraint, n):
        ids = tokenizer.encode(prompt).ids
        cache = cache_lib.init_cache(c, 1, SLOTS)
        logits, cache = step(params, cache, jnp.asarray([ids], jnp.int32))
        last, out = np.asarray(logits[0, -1]), []
        for _ in range(n):
            if constraint is not None:
                last = np.where(constraint.allowed(), last, -np.inf)
            token = int(np.argmax(last))
            if token == c.eos_id:
                break
            out.append(token)
            if constraint is not None:
                constraint.advance(token)
                if constraint.done():
                    break
            logits, cache = step(params, cache, jnp.asarray([[token]], jnp.int32))
            last = np.asarray(logits[0, -1])
        return tokenizer.decode(out)

    return run


def chat(text):
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


PROMPT = chat("Invent a person. Answer with their name, age and city.")


def test_json_schema_output_parses_and_validates(constrained_greedy, smollm2_grammars):
    jsonschema = pytest.importorskip("jsonschema")
    text = constrained_greedy(PROMPT, smollm2_grammars.json_schema(PERSON), 80)
    value = json.loads(text)
    jsonschema.validate(value, PERSON)
    assert list(value) == ["name", "age", "city"]  # the schema's order


def test_without_the_mask_the_same_prompt_is_not_json(constrained_greedy):
    """The must-differ case: the model alone answers in prose."""
    text = constrained_greedy(PROMPT, None, 24)
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_regex_output_matches(constrained_greedy, smollm2_grammars):
    pattern = r"(yes|no), [0-9]{1,3} (apples|pears)"
    text = constrained_greedy(chat("Do you like fruit, and how many do you eat?"),
                              smollm2_grammars.regex(pattern), 20)
    assert re.fullmatch(pattern, text), text


def test_done_waits_while_an_accepting_match_may_still_go_on():
    """Guards `done()` reporting done as soon as EOS is allowed: after "ab" the regex
    `ab(c)?` is a full match, but "c" may still follow, so it is not done; a JSON
    integer may always take another digit, so it is never done before EOS."""
    tokenizer = ByteTokenizer()
    grammars = Grammars(tokenizer, vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id)
    code = lambda ch: ord(ch) + 3  # noqa: E731
    constraint = grammars.regex("ab(c)?")
    constraint.advance(code("a"))
    constraint.advance(code("b"))
    allowed = np.flatnonzero(constraint.allowed()).tolist()
    assert sorted(allowed) == sorted([code("c"), tokenizer.eos_id])
    assert not constraint.done()
    constraint.advance(code("c"))
    assert np.flatnonzero(constraint.allowed()).tolist() == [tokenizer.eos_id]
    assert constraint.done()

    number = grammars.json_schema({"type": "integer"})
    for ch in "42":
        number.advance(code(ch))
        allowed = number.allowed()
        assert allowed[tokenizer.eos_id] and allowed[code("7")]
        assert not number.done()

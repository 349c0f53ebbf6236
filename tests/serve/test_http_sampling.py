"""The sampling fields through the HTTP server to the real engine (a tiny random
byte-level model on a loopback port): min_p is applied in the engine's draw, and an
out-of-range top_k is a 400 that leaves the requests running beside it unharmed."""

from __future__ import annotations

import threading

import pytest

import jaxformer as jf
from tests.serve.server_fixture import post, running

pytest.importorskip("starlette", reason="needs the `serve` extra")

from jaxformer.serve.engine import Engine  # noqa: E402
from jaxformer.serve.http import ServedModel, create_app  # noqa: E402
from jaxformer.text import ByteTokenizer  # noqa: E402

BYTES = ByteTokenizer()
CONFIG = jf.llama(tgt_vocab_size=BYTES.vocab_size, src_vocab_size=BYTES.vocab_size,
                  max_len=64, num_kv_heads=2)
PROMPT = "Once upon a"
SEEDS = range(4)


@pytest.fixture(scope="module")
def url(make_lm):
    engine = Engine(*make_lm(CONFIG, seed=5), BYTES, slots=4, max_len=64, page_size=8,
                    prefill_chunk=16)
    with running(create_app(ServedModel(engine, BYTES, name="tiny", max_len=64))) as base:
        yield base


def tokens(url, **fields) -> list[int]:
    """The generated ids of one completion (its logprobs' tokens, as bytes' ids)."""
    status, _, out = post(url, "/v1/completions",
                          {"prompt": PROMPT, "max_tokens": 8, "logprobs": 0, **fields})
    assert status == 200, out
    return out["choices"][0]["logprobs"]["tokens"]


def test_min_p_one_at_temperature_two_is_greedy(url):
    greedy = tokens(url, temperature=0)
    assert [tokens(url, temperature=2, min_p=1.0, seed=s) for s in SEEDS] == [greedy] * 4
    # the same seeds without min_p sample other tokens: min_p made the difference
    assert all(tokens(url, temperature=2, min_p=0, seed=s) != greedy for s in SEEDS)


def test_a_huge_top_k_is_400_and_its_neighbours_finish(url):
    """top_k 10**12 used to reach the engine, overflow its int32 step column and fail
    every request sharing the step with a 500."""
    results = {}

    def neighbour(seed):
        results[seed] = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 24,
                                                      "temperature": 1, "seed": seed})[0]

    threads = [threading.Thread(target=neighbour, args=(s,)) for s in SEEDS]
    for thread in threads:
        thread.start()
    status, _, error = post(url, "/v1/completions", {"prompt": PROMPT, "top_k": 10 ** 12})
    for thread in threads:
        thread.join(timeout=120)
    assert status == 400 and error["error"]["param"] == "top_k"
    assert f"[-1, {BYTES.vocab_size}]" in error["error"]["message"]
    assert results == {s: 200 for s in SEEDS}

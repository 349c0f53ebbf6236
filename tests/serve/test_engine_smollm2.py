"""SmolLM2-135M (the session's GGUF fixture) through the engine, with and without
prompt-lookup speculation, and in a tuned CPU process (its steps' attention through
`backends.paged_attention`'s kernel): concurrent requests of mixed lengths give
`generate`'s greedy tokens of each prompt alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.backends import cpu, paged_attention, qmatmul
from jaxformer.serve import Engine, FinishReason, Request, SamplingParams

TEXTS = ["The capital of France is",
         "Write a short poem about the sea. The waves roll in and the gulls cry over the "
         "harbour where the fishing boats come home at dusk, and",
         "1, 2, 3, 4,"]
NEW, WIDTH = 12, 48


@pytest.fixture
def fresh_traces():
    """jit's caches cleared before and after: the engine's programs (one function each)
    are traced again under the gate the test sets, not taken from an earlier test's."""
    jax.clear_caches()
    yield
    jax.clear_caches()


@pytest.mark.parametrize("speculative, tuned", [(0, False), (4, False), (0, True)],
                         ids=["plain", "prompt_lookup_k4", "plain_tuned"])
def test_smollm2_concurrent_greedy_equals_generate_alone(smollm2, speculative, tuned,
                                                         request, monkeypatch):
    model, params, tokenizer, _ = smollm2
    if tuned:
        assert qmatmul.library() is not None, "the kernels did not build (g++ is on CI)"
        request.getfixturevalue("fresh_traces")
        monkeypatch.setattr(cpu, "process_tuned", lambda: True)
        assert paged_attention.usable((params["embed"]["embedding"],))
        traced = []  # the kernel's calls, counted as the engine's programs are traced
        kernel = paged_attention.kernel
        monkeypatch.setattr(paged_attention, "kernel",
                            lambda *a, **k: traced.append(1) or kernel(*a, **k))
    prompts = [tokenizer.encode(text).ids for text in TEXTS]
    assert max(map(len, prompts)) <= WIDTH and len({len(p) for p in prompts}) == 3
    engine = Engine(model, params, tokenizer, slots=4, max_len=128, page_size=16,
                    prefill_chunk=16, speculative=speculative)
    handles = [engine.submit(Request(p, SamplingParams(max_tokens=NEW))) for p in prompts]
    engine.run_until_idle()
    for prompt, handle in zip(prompts, handles):
        events = handle.result(0)
        row = np.full((1, WIDTH), model.config.pad_id, np.int32)
        row[0, :len(prompt)] = prompt
        out = jf.generate(model, params, jnp.asarray(row), max_new_tokens=NEW,
                          prompt_lengths=jnp.asarray([len(prompt)]))
        want = [int(t) for t in out.tokens[0][:int(out.lengths[0])]]
        eos = model.config.eos_id
        want = want[:want.index(eos)] if eos in want else want
        assert [e.token for e in events if e.token is not None] == want
        assert "".join(e.text for e in events) == tokenizer.decode(want)
        assert events[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    if tuned:
        assert traced, "the tuned engine's steps did not call the kernel"
    metrics = engine.metrics()
    assert metrics["free_pages"] == metrics["total_pages"]
    assert (metrics["acceptance_rate"] > 0) == (speculative > 0)

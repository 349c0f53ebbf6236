"""Engines compile one program at a time (`serve.programs.COMPILE_LOCK`), and compiling
from several threads at once gives every request `generate`'s tokens.

Issue 65's compile crash: two CI runs lost a worker to a segfault inside XLA:CPU's
compile of an engine step on the engine's thread. The stress below (an engine serving
requests that arrive while a second engine warms up and a third thread compiles other
programs) did not reproduce it; the engines' compiles are serialised all the same.
"""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.serve import Engine, Request, SamplingParams
from tests.families import alone, family_config

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def test_engines_compile_one_at_a_time_while_requests_arrive(make_lm):
    spans = []  # (thread name, start, end) of every backend compile

    def listener(event, duration, **kwargs):
        if event == COMPILE_EVENT:
            end = time.monotonic()
            spans.append((threading.current_thread().name, end - duration, end))

    jax.monitoring.register_event_duration_secs_listener(listener)
    model_a, params_a = make_lm(family_config("llama", num_hidden_layers=3), seed=1)
    model_b, params_b = make_lm(family_config("gemma3"), seed=2)
    serving = Engine(model_a, params_a, slots=2, max_len=32, page_size=4, prefill_chunk=8)
    warming = Engine(model_b, params_b, slots=2, max_len=32, page_size=4, prefill_chunk=8)
    prompts = [[5, 6, 7], [9, 4, 3, 8, 10], [11, 12]]
    handles = []

    def arrive():  # requests arrive while the other engine compiles
        for p in prompts:
            handles.append(serving.submit(Request(p, SamplingParams(max_tokens=6))))
            time.sleep(0.05)

    def other_programs():  # a library user's compiles beside the engines'
        for n in range(3):
            jax.jit(lambda x, n=n: jnp.tanh(x @ x.T + n).sum())(jnp.ones((8 + n, 8)))

    serving.start()
    threads = [threading.Thread(target=warming.warm_up, name="warm-up"),
               threading.Thread(target=arrive), threading.Thread(target=other_programs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = [[e.token for e in h.result(300) if e.token is not None and not e.prompt]
           for h in handles]
    serving.stop()
    jax.monitoring.unregister_event_duration_listener(listener)

    assert got == [alone(model_a, params_a, p, 6) for p in prompts]
    engines = sorted((s, e) for name, s, e in spans if name in ("jaxformer-engine", "warm-up"))
    names = {name for name, _, _ in spans}
    assert {"jaxformer-engine", "warm-up"} <= names  # both engines compiled here
    overlaps = [(a, b) for a, b in zip(engines, engines[1:]) if b[0] < a[1] - 1e-3]
    assert not overlaps, f"{len(overlaps)} engine compiles overlapped"
    assert np.isfinite([e - s for s, e in engines]).all()

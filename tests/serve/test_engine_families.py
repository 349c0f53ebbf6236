"""Every decoder-only family `load` reads, served: tiny random configs of each
(`models.hf.config_from_hf` on a config.json dict, the way a user's directory is read),
through the engine with several slots, the prefix cache and speculation, on prompts
longer than the sliding window, give `generate`'s greedy tokens of each prompt alone."""

import numpy as np
import pytest

from jaxformer.serve import Engine, Request, SamplingParams
from tests.families import FAMILIES, VOCAB, WINDOW, alone, family_config


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_engine_serves_every_family_as_generate_decodes_it(make_lm, family):
    """Two slots for five requests (queueing, chunked prefill, joins while others
    decode), the first and fourth sharing an 8-token prefix (a prefix hit),
    prompt-lookup speculation;
    every prompt but one longer than the window, so a local layer reading past its
    band would change the tokens."""
    config = family_config(family)
    if family != "llama":
        assert config.sliding_window == WINDOW
    model, params = make_lm(config, seed=4)
    rng = np.random.default_rng(5)
    shared = [int(t) for t in rng.integers(3, VOCAB, 8)]
    ps = [shared + [7, 8, 9], [int(t) for t in rng.integers(3, VOCAB, 13)],
          [5, 6, 5, 6, 5, 6, 5], shared + [10, 11], [4, 3]]  # the 4th finds the 1st's pages
    news = (8, 6, 10, 9, 7)
    eng = Engine(model, params, slots=2, max_len=40, page_size=4, prefill_chunk=8,
                 speculative=2)
    handles = [eng.submit(Request(p, SamplingParams(max_tokens=n))) for p, n in zip(ps, news)]
    eng.run_until_idle()
    got = [[e.token for e in h.result(0) if e.token is not None and not e.prompt]
           for h in handles]
    want = [alone(model, params, p, n) for p, n in zip(ps, news)]
    assert got == want
    assert len({tuple(w) for w in want}) == len(want)  # not a degenerate model
    assert eng.metrics()["prefix_hit_rate"] > 0
    assert eng.metrics()["free_pages"] == eng.metrics()["total_pages"]


def test_scanned_serving_of_mixed_layer_kinds_is_refused_by_name(make_lm):
    model, params = make_lm(family_config("gemma3"))
    with pytest.raises(ValueError, match="mixes local and global layers: serve it unrolled"):
        Engine(model, params, slots=1, max_len=32, page_size=4, scan_layers=True)

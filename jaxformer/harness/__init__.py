"""Evaluation harnesses: jaxformer models behind lm-evaluation-harness.

Modules: `packing` (the endings of one context in one row: the layout the scorer
runs), `scoring` (`Scorer`: batched log-likelihoods and generations on token ids,
padded to a few compiled shapes), `lm_eval_model` (`JaxformerLM`, registered as
lm-eval's "jaxformer" model; imports `lm_eval`, the `lm_eval` extra, so it is loaded
on first use of the name). Guide: docs/evaluation.md.
"""

from jaxformer.harness.scoring import Scorer, bucket

__all__ = ["JaxformerLM", "Scorer", "bucket"]


def __getattr__(name):
    if name == "JaxformerLM":
        from jaxformer.harness.lm_eval_model import JaxformerLM  # noqa: PLC0415 - lm_eval

        return JaxformerLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""jaxformer as an lm-evaluation-harness model: `lm_eval --model jaxformer`.

    jaxformer lm-eval --model jaxformer --model_args path=SmolLM2.gguf --tasks hellaswag

or from Python::

    import lm_eval
    from jaxformer.harness import JaxformerLM
    lm = JaxformerLM(path="smollm2-hf", batch_size=16)      # or model=, params=, tokenizer=
    lm_eval.simple_evaluate(model=lm, tasks=["arc_easy"])

lm-evaluation-harness finds models in its own registry only, so importing this
module registers `JaxformerLM` as "jaxformer" (`lm_eval.api.registry.register_model`);
`jaxformer lm-eval ARGS...` imports it and runs `lm_eval`'s own command line
with ARGS. Text handling is lm-eval's `TemplateLM` (context / continuation
splitting, empty contexts, rolling windows), the same code its `hf` model runs;
the token work is `scoring.Scorer` (batched, padded to a few compiled shapes).

Model arguments (`--model_args k=v,...`): `path` (a Hugging Face directory or a
GGUF file, `jaxformer.models.load`), `max_length` (the window, default the
model's), `max_gen_toks` (default 256), `dtype`, `quantize`, `chat_template`
(a Jinja string to use instead of the checkpoint's). The batch (rows per
compiled call, default 8) is lm-eval's `--batch_size`.
"""

from __future__ import annotations

import os
from typing import Optional

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (handle_stop_sequences, normalize_gen_kwargs,
                                  postprocess_generated_text)

from jaxformer.harness.scoring import Scorer


def _positive_int(name: str, value, default: int) -> int:
    """lm-eval passes numbers as strings ("8") and batch sizes as "auto" / "auto:4"."""
    if value is None or (isinstance(value, str) and value.startswith("auto")):
        return default
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"jaxformer model argument {name}={value!r} is not an int") from None
    if number < 1:
        raise ValueError(f"jaxformer model argument {name}={value!r} must be >= 1")
    return number


def check_model_args(arguments: dict) -> None:
    """ValueError naming the first bad `--model_args` value (numbers, then a `path`
    that names nothing), before anything is loaded: `jaxformer lm-eval` calls it
    before lm-eval indexes its tasks."""
    for name in ("max_gen_toks", "max_length", "batch_size"):
        if arguments.get(name) is not None:
            _positive_int(name, arguments[name], 1)
    path = arguments.get("path")
    if path is not None and not os.path.exists(str(path)):
        raise ValueError(f"{path}: no such checkpoint directory or GGUF file")


@register_model("jaxformer")
class JaxformerLM(TemplateLM):
    """A jaxformer `DecoderOnlyLM` behind lm-eval's `loglikelihood`,
    `loglikelihood_rolling` and `generate_until`."""

    def __init__(self, path: Optional[str] = None, *, model=None, params=None, tokenizer=None,
                 batch_size=8, max_length=None, max_gen_toks=256, dtype: str = "float32",
                 quantize: Optional[str] = None, chat_template: Optional[str] = None,
                 device=None, max_batch_size=None):
        # (device, max_batch_size: lm-eval's command line passes them to every model;
        # JAX places arrays on its default device and batches are fixed-size here.)
        super().__init__()
        if (path is None) == (model is None):
            raise ValueError("pass either path= (a checkpoint) or model=, params= and "
                             "tokenizer= (already loaded)")
        # numbers first: nothing is loaded for a bad one
        self.max_gen_toks = _positive_int("max_gen_toks", max_gen_toks, 256)
        window = None if max_length is None else _positive_int("max_length", max_length, 0)
        rows = _positive_int("batch_size", batch_size, 8)
        if path is not None:
            from jaxformer.models import load  # noqa: PLC0415 - the readers load on use

            model, params, tokenizer = load(path, dtype=dtype, quantize=quantize)
        if tokenizer is None:
            raise ValueError("the harness needs a tokenizer (this checkpoint has no "
                             "tokenizer.json); pass tokenizer=")
        if chat_template is None and path is not None:
            from jaxformer.text import chat_template as read_template  # noqa: PLC0415

            chat_template = read_template(path)
        self.tokenizer = tokenizer
        self._template = chat_template
        self._name = os.path.basename(os.path.normpath(path)) if path else "jaxformer"
        self.scorer = Scorer(model, params, batch_size=rows, max_length=window)
        self.config = model.config

    # -- what TemplateLM asks for ---------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.config.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.config.bos_id

    @property
    def max_length(self) -> int:
        return self.scorer.max_length

    @property
    def tokenizer_name(self) -> str:
        return self._name

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None,
                   **kwargs) -> list[int]:
        if add_special_tokens is None:
            # as the hf model: no special tokens added to text that starts with BOS
            bos = self.tokenizer.decode([self.prefix_token_id], skip_special_tokens=False)
            if bos and string.startswith(bos):
                add_special_tokens = False
        if add_special_tokens is None:
            return list(self.tokenizer.encode(string).ids)
        return list(self.tokenizer.encode(string, add_special_tokens=add_special_tokens).ids)

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        tokens = [tokens] if isinstance(tokens, int) else list(tokens)
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        results = self.scorer.loglikelihoods([(ctx, cont) for _, ctx, cont in requests])
        for (key, _, _), answer in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Sum over disjoint windows of the whole text, each conditioned on up to
        `max_length` tokens before it (BOS first), as the hf model computes it."""
        windows, owner = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(lm_utils.make_disjoint_window,
                                             lm_utils.get_rolling_token_windows(
                                                 token_list=self.tok_encode(string),
                                                 prefix_token=self.prefix_token_id,
                                                 max_seq_len=self.max_length,
                                                 context_len=1)):
                windows.append((context, continuation))
                owner.append(index)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owner, self.scorer.loglikelihoods(windows)):
            totals[index] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, with do_sample / temperature) continuations, cut at the
        first stop sequence (`until`, and the EOS text) as the hf model cuts them.
        Requests are batched by their generation arguments."""
        groups: dict = {}
        for index, req in enumerate(requests):
            context, gen_kwargs = req.args
            groups.setdefault(repr(sorted(gen_kwargs.items())), []).append(index)
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        out: list = [None] * len(requests)
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[indices[0]].args[1]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = int(kwargs.pop("max_gen_toks"))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
            if not kwargs.pop("do_sample", False):
                temperature = 0.0
            prompts = [self.tok_encode(requests[i].args[0]) for i in indices]
            generated = self.scorer.generate(
                prompts, max_new_tokens=max_new, temperature=temperature,
                top_k=kwargs.pop("top_k", None), top_p=kwargs.pop("top_p", None))
            for i, ids in zip(indices, generated):
                text = postprocess_generated_text(self.tok_decode(ids), until, None)
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

    # -- chat templates (lm-eval's --apply_chat_template) ---------------------------------

    def chat_template(self, chat_template=False) -> Optional[str]:
        if chat_template is False or chat_template is None:
            return None
        if self._template is None:
            raise ValueError(f"{self._name} ships no chat template: pass "
                             "--model_args chat_template=... or drop --apply_chat_template")
        return self._template

    def apply_chat_template(self, chat_history: list[dict],
                            add_generation_prompt: bool = True) -> str:
        """The conversation rendered as transformers' `apply_chat_template` renders it
        (`continue_final_message` when no generation prompt is added)."""
        from jaxformer.text import render_chat  # noqa: PLC0415

        template = self.chat_template(True)
        specials = {name: self.tokenizer.decode([i], skip_special_tokens=False)
                    for name, i in (("bos_token", self.config.bos_id),
                                    ("eos_token", self.config.eos_id))}
        text = render_chat(template, chat_history,
                           add_generation_prompt=add_generation_prompt, **specials)
        if not add_generation_prompt and chat_history:
            final = chat_history[-1]["content"].strip()
            if final and final in text:  # continue the last message: cut what closes it
                text = text[:text.rindex(final) + len(final)]
        return text

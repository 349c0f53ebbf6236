"""lm-evaluation-harness: jaxformer's "jaxformer" model against lm-eval's own `hf` model
(transformers) on the same weights (SmolLM2 exported to a Hugging Face directory), on
three local tasks built from tests/data/lm_eval: multiple choice, rolling perplexity and
generate-until. Nothing is downloaded."""

import json
import os
import re
import textwrap

import numpy as np
import pytest

from conftest import REPO
from tests.tolerances import decoder_additions, logprob_sum_atol

lm_eval = pytest.importorskip("lm_eval", reason="needs the lm_eval extra: "
                              "pip install 'jaxformer[lm_eval]'")
pytest.importorskip("transformers", reason="the hf reference needs transformers")

DATA = os.path.join(REPO, "tests", "data", "lm_eval")
WINDOW = 64  # short, so the repeated text spans several rolling windows
SMOLLM2_LOGIT_SCALE = 40.0  # its largest |logit| on perplexity.jsonl's texts: 33.6
LIMIT = 6  # docs per task served over HTTP (each request is a round trip)
TASKS = {
    "jf_multiple_choice": """
        output_type: multiple_choice
        doc_to_text: "Question: {{question}}\\nAnswer:"
        doc_to_choice: "{{choices}}"
        doc_to_target: "{{answer}}"
        metric_list:
          - metric: acc
          - metric: acc_norm
        """,
    "jf_perplexity": """
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{text}}"
        metric_list:
          - metric: word_perplexity
          - metric: bits_per_byte
        """,
    "jf_generate": """
        output_type: generate_until
        doc_to_text: "Question: {{question}}\\nAnswer in one word:"
        doc_to_target: "{{answer}}"
        generation_kwargs:
          until: ["\\n", "."]
          max_gen_toks: 12
          do_sample: false
        metric_list:
          - metric: exact_match
            ignore_case: true
            ignore_punctuation: true
        """,
}
FILES = {"jf_multiple_choice": "multiple_choice.jsonl", "jf_perplexity": "perplexity.jsonl",
         "jf_generate": "generate.jsonl"}


def write_tasks(folder):
    """One YAML per task, reading its JSON-lines file through `datasets`' json builder."""
    for name, body in TASKS.items():
        head = textwrap.dedent(f"""\
            task: {name}
            dataset_path: json
            dataset_kwargs:
              data_files:
                test: {os.path.join(DATA, FILES[name])}
            test_split: test
            """)
        (folder / f"{name}.yaml").write_text(head + textwrap.dedent(body))
    return str(folder)


@pytest.fixture(scope="module")
def runs(smollm2, tmp_path_factory):
    """Both models' results (with samples) on the three tasks."""
    from lm_eval.tasks import TaskManager

    from jaxformer.harness import JaxformerLM
    from jaxformer.models.hf_export import save_hf
    from jaxformer.text import chat_template

    model, params, tokenizer, path = smollm2
    hf_dir = str(tmp_path_factory.mktemp("smollm2") / "hf")
    save_hf(model.config, params, hf_dir, tokenizer=tokenizer,
            chat_template=chat_template(path))
    tasks_dir = write_tasks(tmp_path_factory.mktemp("tasks"))
    tasks = TaskManager(include_path=tasks_dir)
    ours = JaxformerLM(model=model, params=params, tokenizer=tokenizer, batch_size=8,
                       max_length=WINDOW)
    from lm_eval.models.huggingface import HFLM

    theirs = HFLM(pretrained=hf_dir, batch_size=8, max_length=WINDOW, device="cpu",
                  dtype="float32")
    out = {}
    for name, lm in (("jaxformer", ours), ("hf", theirs)):
        out[name] = lm_eval.simple_evaluate(model=lm, tasks=sorted(TASKS), task_manager=tasks,
                                            log_samples=True, bootstrap_iters=0)
    out["scorer"] = ours.scorer
    out["hf_dir"], out["tasks_dir"] = hf_dir, tasks_dir
    return out


def responses(result, task):
    return [s["resps"] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


def test_multiple_choice_loglikelihoods_within_1e4_of_hf_and_the_same_accuracies(runs):
    ours, theirs = (responses(runs[k], "jf_multiple_choice") for k in ("jaxformer", "hf"))
    assert len(ours) == 16 and all(len(r) == 4 for r in ours)
    got = np.array([[choice[0][0] for choice in r] for r in ours])
    want = np.array([[choice[0][0] for choice in r] for r in theirs])
    assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()
    assert [[c[0][1] for c in r] for r in ours] == [[c[0][1] for c in r] for r in theirs]
    for metric in ("acc,none", "acc_norm,none"):
        assert (runs["jaxformer"]["results"]["jf_multiple_choice"][metric]
                == runs["hf"]["results"]["jf_multiple_choice"][metric])
    assert runs["jaxformer"]["results"]["jf_multiple_choice"]["acc,none"] > 0.4  # not chance


def test_rolling_loglikelihoods_are_hfs_within_float32_rounding(runs, smollm2):
    """Each text's sum of log-probabilities within float32's bound for its tokens' sums
    (tests/tolerances.py), at SmolLM2's logit scale; both metrics within the bound of
    the sum over all texts: bits per byte is -sum / (bytes ln 2) (relative error
    dS / |S|), word perplexity exp(-sum / words) (relative error dS / words)."""
    model, _, tokenizer, _ = smollm2
    ours, theirs = (responses(runs[k], "jf_perplexity") for k in ("jaxformer", "hf"))
    got, want = np.array([r[0][0] for r in ours]), np.array([r[0][0] for r in theirs])
    with open(os.path.join(DATA, FILES["jf_perplexity"])) as f:
        texts = [json.loads(line)["text"] for line in f]
    tokens = [len(tokenizer.encode(text)) for text in texts]
    c = model.config
    additions = decoder_additions(c.d_model, c.d_ff, c.head_dim, c.num_decoder_layers,
                                  WINDOW, c.tgt_vocab_size)
    bounds = [logprob_sum_atol(SMOLLM2_LOGIT_SCALE, additions, n) for n in tokens]
    assert len(got) == 4 and (np.abs(got - want) <= bounds).all(), (got - want, bounds)
    total = logprob_sum_atol(SMOLLM2_LOGIT_SCALE, additions, sum(tokens))
    words = sum(len(re.split(r"\s+", text)) for text in texts)  # lm-eval's word count
    for metric, rtol in (("bits_per_byte,none", total / abs(want.sum())),
                         ("word_perplexity,none", total / words)):
        np.testing.assert_allclose(runs["jaxformer"]["results"]["jf_perplexity"][metric],
                                   runs["hf"]["results"]["jf_perplexity"][metric], rtol=rtol)


def test_generations_are_hfs(runs):
    ours, theirs = (responses(runs[k], "jf_generate") for k in ("jaxformer", "hf"))
    ours, theirs = [r[0][0] for r in ours], [r[0][0] for r in theirs]
    assert len(ours) == 6 and ours == theirs
    assert sum(bool(text.strip()) for text in ours) >= 3, ours  # something was generated
    assert (runs["jaxformer"]["results"]["jf_generate"]["exact_match,none"]
            == runs["hf"]["results"]["jf_generate"]["exact_match,none"])


def test_a_task_compiles_a_few_shapes_not_one_per_request(runs):
    """16 x 4 choices + 4 texts (several windows) + 6 prompts in batches of 8: the
    scoring program is compiled per length bucket, the generator once."""
    scorer = runs["scorer"]
    shapes = scorer.shapes
    assert {s[1] for s in shapes} == {8}
    assert scorer.traces == len([s for s in shapes if s[0] == "score"]) <= 4
    assert len([s for s in shapes if s[0] == "generate"]) == 1


def test_the_command_line_loads_the_exported_directory_and_gives_the_same_accuracy(
        runs, tmp_path, capsys):
    """`jaxformer lm-eval --model jaxformer --model_args path=DIR ...` is lm-eval's command
    line with the model registered: the exported directory read by jaxformer's loader
    scores the multiple-choice task as the in-memory model did."""
    import glob
    import json

    from jaxformer.cli.main import main

    assert main(["lm-eval", "--model", "jaxformer", "--model_args",
                 f"path={runs['hf_dir']},max_length={WINDOW}", "--batch_size", "8",
                 "--tasks", "jf_multiple_choice", "--include_path", runs["tasks_dir"],
                 "--output_path", str(tmp_path)]) == 0
    (path,) = glob.glob(str(tmp_path / "**" / "results_*.json"), recursive=True)
    with open(path) as f:
        results = json.load(f)["results"]["jf_multiple_choice"]
    want = runs["jaxformer"]["results"]["jf_multiple_choice"]
    assert results["acc,none"] == want["acc,none"]
    assert results["acc_norm,none"] == want["acc_norm,none"]
    assert "jf_multiple_choice" in capsys.readouterr().out  # lm-eval's table


@pytest.mark.parametrize("model_args, tasks, message", [
    ("path=/no/such/model,max_length=x", "jf_multiple_choice", "max_length='x' is not an int"),
    ("path=/no/such/model", "jf_multiple_choice", "/no/such/model: no such checkpoint"),
])
def test_bad_input_is_one_line_and_exit_2(model_args, tasks, message, capsys, tmp_path,
                                          monkeypatch):
    """Checked before lm-eval runs (it would index its thousands of tasks first)."""
    import logging

    import lm_eval.__main__

    from jaxformer.cli.main import main

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate",
                        lambda: pytest.fail("lm-eval ran before the model arguments were checked"))
    # lm-eval's log handler still holds an earlier test's captured stderr: no page about it
    monkeypatch.setattr(logging, "raiseExceptions", False)
    assert main(["lm-eval", "--model", "jaxformer", "--model_args", model_args, "--tasks", tasks,
                 "--include_path", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("jaxformer lm-eval: error: ") and message in err[-1], err
    assert not any("Traceback" in line for line in err)


def test_the_servers_completions_route_as_local_completions_gives_the_same_numbers(runs,
                                                                                   smollm2):
    """`jaxformer serve`'s /v1/completions as lm-eval's `local-completions` model (token-id
    prompts, echo + logprobs for log-likelihoods, stop strings for generation): the same
    per-sample log-likelihoods as the "jaxformer" model within 1e-4, the same generations."""
    pytest.importorskip("uvicorn", reason="needs the serve extra")
    pytest.importorskip("starlette", reason="needs the serve extra")
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    from jaxformer.serve.engine import Engine
    from jaxformer.serve.http import ServedModel, create_app
    from jaxformer.text import JSONTokenizer
    from tests.serve.server_fixture import running

    model, params, raw_tokenizer, _ = smollm2
    c = model.config
    tokenizer = JSONTokenizer.wrap(raw_tokenizer, pad_id=c.pad_id, bos_id=c.bos_id,
                                   eos_id=c.eos_id, vocab_size=c.tgt_vocab_size)
    # One slot, 16-token prefill chunks: every request is prefilled in one program shape
    # (echo or not) and decoded in one; 4 slots and 64-token chunks compiled 6 prefill
    # shapes (rows x width x echo). Batched rows and echo: tests/serve/test_engine.py.
    engine = Engine(model, params, tokenizer, slots=1, max_len=c.decoder_len, page_size=16,
                    prefill_chunk=16, max_queue=64)
    served = ServedModel(engine, tokenizer, name="smollm2", max_len=c.decoder_len)
    with running(create_app(served)) as url:
        api = LocalCompletionsAPI(base_url=f"{url}/v1/completions", model="smollm2",
                                  tokenizer=runs["hf_dir"], tokenizer_backend="huggingface",
                                  # lm-eval's API models keep 1 token for generation and
                                  # 1 for context: rolling windows of max_length - 2 tokens
                                  max_length=WINDOW + 2, num_concurrent=4, max_retries=1)
        # the first LIMIT docs of each task (every rolling text and prompt, 6 of the
        # 16 questions): each request is a round trip, the server's compiles are the same
        served_out = lm_eval.simple_evaluate(
            model=api, tasks=sorted(TASKS), task_manager=TaskManager(
                include_path=runs["tasks_dir"]), log_samples=True, bootstrap_iters=0,
            limit=LIMIT)
    # a doc's log-likelihoods: (ll, greedy) per choice; one ll per rolling text
    lls = {"jf_multiple_choice": lambda r: [choice[0][0] for choice in r],
           "jf_perplexity": lambda r: [r[0][0]]}
    for task, doc_lls in lls.items():
        ours, theirs = responses(runs["jaxformer"], task)[:LIMIT], responses(served_out, task)
        got = np.array([doc_lls(r) for r in ours])
        want = np.array([doc_lls(r) for r in theirs])
        assert got.shape == want.shape and got.size >= 4, task
        assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max()), task
    assert ([r[0][0] for r in responses(runs["jaxformer"], "jf_generate")]
            == [r[0][0] for r in responses(served_out, "jf_generate")])
    ours_mc = [[c[0] for c in r] for r in responses(runs["jaxformer"], "jf_multiple_choice")]
    theirs_mc = [[c[0] for c in r] for r in responses(served_out, "jf_multiple_choice")]
    # the same choice picked per question (what acc counts), on the questions served
    assert ([int(np.argmax([c[0] for c in r])) for r in ours_mc[:LIMIT]]
            == [int(np.argmax([c[0] for c in r])) for r in theirs_mc])

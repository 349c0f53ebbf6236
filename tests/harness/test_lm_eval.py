"""lm-evaluation-harness: jaxformer's "jaxformer" model against lm-eval's own `hf` model
(transformers) on the same weights (SmolLM2 exported to a Hugging Face directory), on
three local tasks built from tests/data/lm_eval: multiple choice, rolling perplexity and
generate-until. Nothing is downloaded."""

import os
import textwrap

import numpy as np
import pytest

from conftest import REPO

lm_eval = pytest.importorskip("lm_eval", reason="needs the lm_eval extra: "
                              "pip install 'jaxformer[lm_eval]'")
pytest.importorskip("transformers", reason="the hf reference needs transformers")

DATA = os.path.join(REPO, "tests", "data", "lm_eval")
WINDOW = 64  # short, so the repeated text spans several rolling windows
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
    tasks = TaskManager(include_path=write_tasks(tmp_path_factory.mktemp("tasks")))
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


def test_rolling_loglikelihoods_within_1e4_of_hf(runs):
    ours, theirs = (responses(runs[k], "jf_perplexity") for k in ("jaxformer", "hf"))
    got, want = np.array([r[0][0] for r in ours]), np.array([r[0][0] for r in theirs])
    assert len(got) == 4 and np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
    for metric in ("word_perplexity,none", "bits_per_byte,none"):
        np.testing.assert_allclose(runs["jaxformer"]["results"]["jf_perplexity"][metric],
                                   runs["hf"]["results"]["jf_perplexity"][metric], rtol=1e-5)


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
    shapes = runs["scorer"].shapes
    assert {s[1] for s in shapes} == {8}
    assert len([s for s in shapes if s[0] == "score"]) <= 3
    assert len([s for s in shapes if s[0] == "generate"]) == 1

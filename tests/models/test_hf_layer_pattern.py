"""Which layers of a Hugging Face config are local (sliding-window) and which global, as
`hf.config_from_hf` reads them, against golden lists of the rule in `transformers`' own
config classes (transformers 5.x source; the same rule as 4.x):

  Gemma2Config:  layer i is "sliding_attention" iff (i + 1) % 2, i.e. even layers local
  Gemma3TextConfig: iff (i + 1) % sliding_window_pattern (default 6): 5 local, then 1 global
  Qwen2Config:   iff sliding_window is set and i >= max_window_layers

A config.json that omits `layer_types` is read by this rule; one that states it is read
as it is. No optional package needed; `test_the_rule_is_transformers_own` compares with
transformers itself where it is installed."""

import pytest

from jaxformer.models import hf

SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64)

# (architecture, config.json fields, golden pattern: "L" local, "G" global)
CASES = {
    "gemma2_5_layers": ("Gemma2ForCausalLM", dict(num_hidden_layers=5, sliding_window=4),
                        "LGLGL"),
    "gemma3_default_6": ("Gemma3ForCausalLM", dict(num_hidden_layers=8, sliding_window=4),
                         "LLLLLGLL"),
    "gemma3_pattern_3": ("Gemma3ForCausalLM", dict(num_hidden_layers=7, sliding_window=4,
                                                   sliding_window_pattern=3), "LLGLLGL"),
    "gemma3_stated": ("Gemma3ForCausalLM", dict(
        num_hidden_layers=3, sliding_window=4,
        layer_types=["full_attention", "sliding_attention", "full_attention"]), "GLG"),
    "qwen2_max_window_2": ("Qwen2ForCausalLM", dict(num_hidden_layers=4, sliding_window=4,
                                                    use_sliding_window=True,
                                                    max_window_layers=2), "GGLL"),
    # Qwen2Config's defaults: sliding_window 4096, max_window_layers 28.
    "qwen2_defaults": ("Qwen2ForCausalLM", dict(num_hidden_layers=30, use_sliding_window=True),
                       "G" * 28 + "LL"),
}


def config(arch, fields):
    return hf.config_from_hf(dict(architectures=[arch]) | SIZES | fields)


@pytest.mark.parametrize("case", list(CASES))
def test_local_and_global_layers_follow_the_hf_rule(case):
    arch, fields, golden = CASES[case]
    got = config(arch, fields)
    layers = fields["num_hidden_layers"]
    assert "".join("L" if local else "G" for local in got.local_layers(layers)) == golden
    assert got.sliding_window == fields.get("sliding_window", 4096)


def test_the_rule_is_transformers_own():
    transformers = pytest.importorskip("transformers")
    classes = {"Gemma2ForCausalLM": transformers.Gemma2Config,
               "Gemma3ForCausalLM": transformers.Gemma3TextConfig,
               "Qwen2ForCausalLM": transformers.Qwen2Config}
    for case, (arch, fields, golden) in CASES.items():
        types = classes[arch](**(SIZES | fields)).layer_types
        assert "".join("L" if t == "sliding_attention" else "G" for t in types) == golden, case

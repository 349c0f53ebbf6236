"""Bad input is refused with an error naming the argument, eagerly and under jit.

Shape/dtype errors come from static shapes, so they fire at trace time under
`jax.jit` too. Token *values* are only checked on concrete arrays: inside jit
an out-of-range id embeds as NaN (documented in jaxformer.nn.checks), so the
logits of that row are NaN rather than silently those of a clamped id.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf

B, S, T, D = 2, 5, 4, 32


@pytest.fixture(scope="module")
def seq2seq(make_transformer):
    return make_transformer(jf.tiny())  # vocab 16, max_len 32


@pytest.fixture(scope="module")
def lm(make_lm):
    return make_lm(jf.tiny(num_encoder_layers=0))


SRC = jnp.full((B, S), 3, jnp.int32)
TGT = jnp.full((B, T), 4, jnp.int32)
MEMORY = jnp.ones((B, S, D))


def call(src=SRC, tgt=TGT, src_mask=None, tgt_mask=None):
    return lambda m, p: m.apply({"params": p}, src, tgt, src_mask, tgt_mask)


def decode(tgt=TGT, memory=MEMORY, src_mask=None):
    return lambda m, p: m.apply({"params": p}, tgt, memory, src_mask, method=m.decode)


def encode(src=SRC, src_mask=None):
    return lambda m, p: m.apply({"params": p}, src, src_mask, method=m.encode)


# name -> (function of (model, params), exception type, regex the message must match)
SHAPE_ERRORS = {
    "src_rank_1": (call(src=SRC[0]), AssertionError, "argument src must be"),
    "src_rank_1_same_length_as_batch": (call(src=jnp.full((B,), 3)), AssertionError,
                                        "argument src must be"),
    "tgt_rank_1": (call(tgt=TGT[0]), AssertionError, "argument tgt must be"),
    "tgt_rank_3": (call(tgt=TGT[..., None]), AssertionError, "argument tgt must be"),
    "tgt_float": (call(tgt=TGT.astype(jnp.float32)), TypeError, "tgt must hold integer"),
    "src_longer_than_max_len": (call(src=jnp.full((B, 33), 3)), ValueError,
                                "src has length 33, longer than the model's max_len=32"),
    "tgt_longer_than_max_len": (call(tgt=jnp.full((B, 40), 3)), ValueError,
                                "tgt has length 40, longer than"),
    "src_tgt_batch_mismatch": (call(tgt=TGT[:1]), ValueError, r"batch sizes disagree.*src.*tgt"),
    "memory_tgt_batch_mismatch": (decode(memory=jnp.ones((3, S, D))), ValueError,
                                  r"batch sizes disagree.*tgt.*memory"),
    "memory_wrong_d_model": (decode(memory=jnp.ones((B, S, 16))), ValueError,
                             "memory has feature size 16, expected d_model=32"),
    "memory_rank_2": (decode(memory=jnp.ones((B, S))), AssertionError, "argument memory"),
    "src_mask_wrong_key_size": (call(src_mask=jnp.ones((B, 1, 1, S + 1), bool)), ValueError,
                                "src_mask has key size 6"),
    "src_mask_wrong_batch": (call(src_mask=jnp.ones((3, 1, 1, S), bool)), ValueError,
                             "src_mask has batch size 3"),
    "src_mask_wrong_heads": (call(src_mask=jnp.ones((B, 3, 1, S), bool)), ValueError,
                             "src_mask has head size 3, expected 1 or 4"),
    "tgt_mask_wrong_heads": (call(tgt_mask=jnp.ones((B, 2, T, T), bool)), ValueError,
                             "tgt_mask has head size 2"),
    "src_mask_rank_3": (call(src_mask=jnp.ones((B, 1, S), bool)), AssertionError,
                        "argument src_mask"),
    "src_mask_not_bool": (call(src_mask=jnp.ones((B, 1, 1, S), jnp.int32)), TypeError,
                          "src_mask must be boolean"),
    "tgt_mask_wrong_query_size": (call(tgt_mask=jnp.ones((B, 1, T + 1, T), bool)), ValueError,
                                  "tgt_mask has query size 5"),
    "tgt_mask_float": (call(tgt_mask=jnp.ones((1, 1, T, T))), TypeError,
                       "tgt_mask must be boolean"),
    "decode_src_mask_wrong_keys": (decode(src_mask=jnp.ones((B, 1, 1, S - 1), bool)),
                                   ValueError, "src_mask has key size 4"),
    "embedded_src_wrong_d_model": (encode(src=jnp.ones((B, S, 16))), ValueError,
                                   "src has feature size 16, expected d_model=32"),
    "embedded_src_too_long": (call(src=jnp.ones((B, 33, D)), src_mask=None), ValueError,
                              "src has length 33"),
    "embedded_src_integer": (encode(src=jnp.ones((B, S, D), jnp.int32)), TypeError,
                             "src must be floating point"),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", list(SHAPE_ERRORS))
def test_shape_errors_name_the_argument(seq2seq, case, jit):
    model, params = seq2seq
    fn, error, message = SHAPE_ERRORS[case]
    run = jax.jit(lambda p: fn(model, p)) if jit else (lambda p: fn(model, p))
    with pytest.raises(error, match=message):
        run(params)


LM_SHAPE_ERRORS = {
    "tokens_rank_1": (lambda: jnp.full((T,), 3), None, AssertionError, "argument tokens"),
    "tokens_too_long": (lambda: jnp.full((B, 33), 3), None, ValueError,
                        "tokens has length 33"),
    "mask_wrong_keys": (lambda: TGT, lambda: jnp.ones((B, 1, T, T + 1), bool), ValueError,
                        "mask has key size 5"),
    "mask_wrong_heads": (lambda: TGT, lambda: jnp.ones((B, 5, T, T), bool), ValueError,
                         "mask has head size 5"),
    "mask_not_bool": (lambda: TGT, lambda: jnp.ones((B, 1, T, T), jnp.float32), TypeError,
                      "mask must be boolean"),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", list(LM_SHAPE_ERRORS))
def test_decoder_only_shape_errors(lm, case, jit):
    model, params = lm
    tokens, mask, error, message = LM_SHAPE_ERRORS[case]
    mask = None if mask is None else mask()

    def run(p):
        return model.apply({"params": p}, tokens(), mask)

    with pytest.raises(error, match=message):
        (jax.jit(run) if jit else run)(params)


@pytest.mark.parametrize("where,bad_id", [("src", 16), ("src", -1), ("tgt", 99), ("tgt", -3)],
                         ids=["src_id_eq_vocab", "src_negative", "tgt_too_big", "tgt_negative"])
def test_out_of_vocabulary_ids_raise_eagerly(seq2seq, where, bad_id):
    model, params = seq2seq
    src = SRC.at[1, 2].set(bad_id) if where == "src" else SRC
    tgt = TGT.at[0, 1].set(bad_id) if where == "tgt" else TGT
    message = rf"{where} holds token ids outside \[0, 16\): \[{bad_id}\]"
    with pytest.raises(ValueError, match=message):
        model.apply({"params": params}, src, tgt)


def test_out_of_vocabulary_ids_raise_eagerly_in_decoder_only(lm):
    model, params = lm
    with pytest.raises(ValueError, match=r"tokens holds token ids outside \[0, 16\): \[-1, 16\]"):
        model.apply({"params": params}, TGT.at[0, 0].set(16).at[1, 3].set(-1))


def test_out_of_vocabulary_ids_under_jit_give_nan_logits_not_a_clamped_id(seq2seq, lm):
    """Documented behaviour: inside jit no value check is possible; the bad row is NaN."""
    model, params = seq2seq
    apply = jax.jit(lambda p, s, t: model.apply({"params": p}, s, t))
    clean = np.asarray(apply(params, SRC, TGT))
    assert np.isfinite(clean).all()
    for src, tgt in [(SRC.at[0, 1].set(16), TGT), (SRC.at[0, 1].set(-1), TGT)]:
        logits = np.asarray(apply(params, src, tgt))
        assert np.isnan(logits[0]).all()  # the whole memory row is poisoned
        np.testing.assert_allclose(logits[1], clean[1], atol=1e-6)  # other rows unaffected
    logits = np.asarray(apply(params, SRC, TGT.at[0, 2].set(20)))
    # The whole row, earlier positions included: masked weights are 0, but 0 * NaN = NaN.
    assert np.isnan(logits[0]).all()
    np.testing.assert_allclose(logits[1], clean[1], atol=1e-6)
    lm_model, lm_params = lm
    lm_logits = jax.jit(lambda p, t: lm_model.apply({"params": p}, t))(lm_params,
                                                                      TGT.at[1, 0].set(-5))
    assert np.isnan(np.asarray(lm_logits[1])).all()
    assert np.isfinite(np.asarray(lm_logits[0])).all()


def test_decoder_only_refuses_encoder_layers():
    model = jf.DecoderOnlyLM(jf.tiny(num_encoder_layers=2))
    with pytest.raises(ValueError, match="num_encoder_layers=0"):
        jax.eval_shape(model.init, jax.random.PRNGKey(0), jax.ShapeDtypeStruct((1, 4), jnp.int32))


def test_per_head_masks_are_accepted(seq2seq):
    """(B, H, T, S) masks are legal: hiding key 4 in every head equals the padding mask."""
    model, params = seq2seq
    per_head = jnp.ones((B, 4, 1, S), bool).at[:, :, :, 4].set(False)
    padding = jnp.ones((B, 1, 1, S), bool).at[:, :, :, 4].set(False)
    np.testing.assert_allclose(model.apply({"params": params}, SRC, TGT, per_head),
                               model.apply({"params": params}, SRC, TGT, padding), atol=1e-6)


def test_check_tokens_is_a_no_op_on_tracers_but_checks_shapes():
    from jaxformer.nn import checks

    @jax.jit
    def f(tokens):
        checks.check_tokens("tokens", tokens, vocab_size=4)  # values unknown: no error
        return tokens

    f(jnp.array([[9, -1]]))
    with pytest.raises(AssertionError, match="argument tokens"):
        f(jnp.array([9, -1]))


# Every public entry point of decoding and training that takes token ids, with an
# id outside the vocabulary (16) put where that entry point reads ids. Each must
# raise ValueError naming its argument on the host, before anything is dispatched
# (the jitted functions would otherwise return NaN or a silently wrong result).
def _entry_points():
    from jaxformer.decode import beam, api as decoding
    from jaxformer.train import evaluation
    from jaxformer.train.tasks import Batch

    bad_src = np.asarray(SRC).copy()
    bad_src[1, 2] = 16
    prompt = np.asarray(TGT).copy()
    prompt[0, 1] = -2
    batch = Batch(np.asarray(SRC), np.asarray(TGT), np.asarray(TGT))
    key = jax.random.PRNGKey(0)
    return {
        "greedy_decode": (lambda m, p, lm, lp: decoding.greedy_decode(
            m, p, bad_src, max_new_tokens=3), "src_BS"),
        "greedy_decode_recompute": (lambda m, p, lm, lp: decoding.greedy_decode_recompute(
            m, p, bad_src, max_new_tokens=3), "src_BS"),
        "sample": (lambda m, p, lm, lp: decoding.sample(
            m, p, bad_src, max_new_tokens=3, rng=key), "src_BS"),
        "beam_search": (lambda m, p, lm, lp: beam.beam_search(
            m, p, bad_src, max_new_tokens=3, beam_size=2), "src_BS"),
        "greedy_decode_one": (lambda m, p, lm, lp: decoding.greedy_decode_one(
            m, p, bad_src[1], max_new_tokens=3), "src_S"),
        "generate": (lambda m, p, lm, lp: decoding.generate(
            lm, lp, prompt, max_new_tokens=3), "prompt_BP"),
        "generate_sampled": (lambda m, p, lm, lp: decoding.generate(
            lm, lp, prompt, max_new_tokens=3, rng=key, temperature=1.0), "prompt_BP"),
        "evaluate_src": (lambda m, p, lm, lp: evaluation.evaluate(
            m, p, batch._replace(src=bad_src)), "batch.src"),
        "evaluate_tgt_in": (lambda m, p, lm, lp: evaluation.evaluate(
            m, p, batch._replace(tgt_in=prompt)), "batch.tgt_in"),
        "evaluate_labels": (lambda m, p, lm, lp: evaluation.evaluate(
            m, p, batch._replace(labels=np.where(batch.labels == 4, 99, batch.labels))),
            "batch.labels"),
    }


ENTRY_POINTS = _entry_points()


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_every_entry_point_refuses_out_of_vocabulary_ids_on_the_host(seq2seq, lm, entry,
                                                                      monkeypatch):
    from jaxformer.decode import beam, api as decoding
    from jaxformer.train import evaluation

    def no_dispatch(*args, **kwargs):
        raise AssertionError("a jitted function was called before the ids were checked")

    # The check must come first: nothing compiled or dispatched.
    for name in ("encdec_program", "_recompute_jit", "lm_program"):
        monkeypatch.setattr(decoding, name, no_dispatch)
    monkeypatch.setattr(beam, "_beam_jit", no_dispatch)
    monkeypatch.setattr(evaluation, "make_eval_step", no_dispatch)
    call, argument = ENTRY_POINTS[entry]
    with pytest.raises(ValueError, match=rf"{argument} holds token ids outside \[0, 16\)"):
        call(*seq2seq, *lm)


def test_evaluate_refuses_mismatched_batches(seq2seq):
    from jaxformer.train.tasks import Batch
    from jaxformer.train import evaluate

    model, params = seq2seq
    with pytest.raises(ValueError, match="batch sizes disagree"):
        evaluate(model, params, Batch(SRC, TGT[:1], TGT[:1]))
    with pytest.raises(ValueError, match="batch.tgt_in .* and batch.labels"):
        evaluate(model, params, Batch(SRC, TGT, TGT[:, :3]))

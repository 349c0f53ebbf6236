"""Speech packing (`whisper.speech`): silero's rules, the packing into chunks and the
time map against faster-whisper's own (`faster_whisper.vad`, fed the same frame
probabilities), and the energy detector's regions on synthetic signals with speech
at known times; then the packed transcription (`transcribe(vad_filter=...)`) on a
file made from the committed clip: times come back where the clip was put (segments
and words, against the clip transcribed alone), the text is faster-whisper's
batched pipeline's, a file without speech gives no segment, bad options are named."""

import numpy as np
import pytest

from jaxformer.models import whisper

FOX = "tests/data/fox_espeak.wav"
SR = whisper.SAMPLE_RATE
FRAME = 512


def fake_vad(monkeypatch, probs):
    """faster-whisper's `get_speech_timestamps` reading `probs` instead of silero's."""
    vad = pytest.importorskip("faster_whisper.vad", reason="needs the test extra")
    monkeypatch.setattr(vad, "get_vad_model", lambda: lambda audio: np.asarray(probs)[:, None])
    return vad


RULE_CASES = {
    # frame probabilities: speech bursts, pauses shorter and longer than 160 ms,
    # hovering between the two thresholds, a region over 30 s cut at a pause
    "bursts": [0] * 20 + [1] * 30 + [0] * 3 + [1] * 10 + [0] * 40 + [1] * 5 + [0] * 20,
    "hold": [0] * 10 + [0.9] * 5 + [0.4] * 30 + [0.2] * 10 + [0.6] * 8 + [0] * 60,
    "long": ([1] * 300 + [0] * 4) * 4 + [0] * 30,
    "no pause": [1] * 1200,
    "to the end": [0] * 50 + [1] * 40,
    "silence": [0] * 200,
}


@pytest.mark.parametrize("name", list(RULE_CASES))
def test_rules_are_faster_whispers(name, monkeypatch):
    probs = RULE_CASES[name]
    n = len(probs) * FRAME - 100
    vad = fake_vad(monkeypatch, probs)
    theirs = vad.get_speech_timestamps(np.zeros(n, np.float32), vad.VadOptions(
        max_speech_duration_s=30, min_silence_duration_ms=160))
    ours = whisper.regions_of_frames(probs, n)
    assert ours == [(r["start"], r["end"]) for r in theirs]


def test_packing_and_time_map_are_faster_whispers(monkeypatch):
    vad = pytest.importorskip("faster_whisper.vad", reason="needs the test extra")
    rng = np.random.default_rng(0)
    regions, end = [], 0
    for _ in range(40):  # gaps of 0.5 to 12 s, regions of 0.25 to 20 s
        start = end + int(rng.integers(SR // 2, 12 * SR))
        end = start + int(rng.integers(SR // 4, 20 * SR))
        regions.append((start, end))
    chunks = whisper.pack(regions)
    ramp = np.arange(regions[-1][1], dtype=np.float32)  # each sample names its place
    audio, meta = vad.collect_chunks(ramp, [{"start": a, "end": b} for a, b in regions],
                                     max_duration=30)
    assert len(chunks) == len(audio) > 5
    for chunk, theirs, m in zip(chunks, audio, meta):
        np.testing.assert_array_equal(whisper.chunk_samples(ramp, chunk), theirs)
        assert sum(b - a for a, b in chunk) / SR == pytest.approx(m["duration"])
    ts_map = vad.SpeechTimestampsMap([{"start": a, "end": b} for a, b in regions], SR)
    offset = 0.0
    for chunk in chunks:
        duration = sum(b - a for a, b in chunk) / SR
        for t in rng.uniform(0, duration, 20):
            assert whisper.original_time(chunk, t) == pytest.approx(
                ts_map.get_original_time(offset + t), abs=0.006)
        end = whisper.original_time(chunk, duration, is_end=True)
        assert end == pytest.approx(chunk[-1][1] / SR)
        offset += duration


def signal(seconds, bursts, level=0.1, noise=1e-4, seed=0):
    """Seeded noise at `noise` with 1 kHz tone bursts at (start s, end s)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, noise, int(seconds * SR))
    t = np.arange(len(x)) / SR
    for a, b in bursts:
        inside = (t >= a) & (t < b)
        x[inside] += level * np.sin(2 * np.pi * 1000 * t[inside])
    return x.astype(np.float32)


def test_regions_of_a_synthetic_signal():
    bursts = [(2.0, 3.5), (3.7, 5.0), (20.0, 22.25), (61.0, 61.5)]  # 0.2 s pause: joined
    x = signal(70, bursts)
    regions = whisper.speech_regions(x)
    pad = 0.4
    expected = [(2.0 - pad, 5.0 + pad), (20.0 - pad, 22.25 + pad), (61.0 - pad, 61.5 + pad)]
    assert len(regions) == len(expected)
    for (a, b), (ea, eb) in zip(regions, expected):
        assert abs(a / SR - ea) <= FRAME / SR and abs(b / SR - eb) <= 2 * FRAME / SR
    # the file is read in pieces (a WAV file, a media file): the frames are still
    # consecutive 512-sample frames of the whole signal
    frames = np.pad(x.astype(np.float64), (0, -len(x) % FRAME)).reshape(-1, FRAME)
    np.testing.assert_allclose(whisper.frame_levels(whisper.Samples(x)),
                               10 * np.log10((frames ** 2).mean(1)), atol=1e-3)
    assert whisper.speech_regions(whisper.Samples(x)) == regions
    quiet = signal(70, [(30.0, 31.0)], level=3e-4)  # 6.5 dB above the noise: not speech
    assert whisper.speech_regions(quiet) == []
    assert whisper.speech_regions(signal(40, [])) == []
    assert whisper.speech_regions(np.zeros(SR * 40, np.float32)) == []


def test_options_are_checked():
    with pytest.raises(ValueError, match="margin_db must be a finite number >= 0"):
        whisper.SpeechOptions(margin_db=-1)
    with pytest.raises(ValueError, match="max_speech_s"):
        whisper.SpeechOptions(max_speech_s=0.5)


PLACES = (3.0, 41.3)  # seconds where the clip is put


@pytest.fixture(scope="module")
def placed():
    """The clip at each of `PLACES` in 50 s of quiet noise."""
    fox = whisper.read_wav(FOX)
    x = np.random.default_rng(2).normal(0, 1e-4, 50 * SR).astype(np.float32)
    for t in PLACES:
        x[int(t * SR):int(t * SR) + len(fox)] += fox
    return x


GREEDY = dict(temperature=0.0, beam_size=1, condition_on_previous_text=False)


def file_time(regions, t):
    """Seconds into the audio of `regions` played one after another, as seconds of the
    file (the time map, written out for the test)."""
    for a, b in regions:
        if t <= (b - a) / SR or (a, b) == regions[-1]:
            return a / SR + t
        t -= (b - a) / SR


def test_packed_times_come_back(whisper_and_faster, placed):
    """Each clip is found where it was put (its region starts 0.4 s of padding before
    it); both are packed in one chunk; the segments and words of the packed
    transcription are those of the chunk's audio transcribed as a file of its own,
    with each time mapped back to the file (a word by its middle): within 0.01 s
    (both round to 0.01 s), and each clip's words start where it was put."""
    w, _ = whisper_and_faster
    regions = whisper.speech_regions(placed)
    assert len(regions) == len(PLACES)
    for (a, _), place in zip(regions, PLACES):
        assert abs(a / SR - (place - 0.4)) <= 0.05
    [chunk] = whisper.pack(regions)
    packed = whisper.transcribe(w, placed, word_timestamps=True, vad_filter=True, **GREEDY)
    alone = whisper.transcribe(w, whisper.chunk_samples(placed, chunk), word_timestamps=True,
                               **GREEDY)
    assert packed.text == alone.text and len(packed.segments) == len(alone.segments) == 2
    for ours, ref, place in zip(packed.segments, alone.segments, PLACES):
        assert ours.text == ref.text and len(ours.words) == len(ref.words) > 5
        for x, y in zip(ours.words, ref.words):
            middle = file_time(regions, (y.start + y.end) / 2) - (y.start + y.end) / 2
            assert abs(x.start - (y.start + middle)) <= 0.011
            assert abs(x.end - (y.end + middle)) <= 0.011
        assert (ours.start, ours.end) == (ours.words[0].start, ours.words[-1].end)
        assert place - 0.45 <= ours.words[0].start <= place + 0.1
        assert place + 1 < ours.words[-1].end < place + 5


def test_text_is_faster_whispers_batched(whisper_and_faster, placed):
    """The default (speech packing on: no timestamps, no conditioning, over 30 s)
    against `BatchedInferencePipeline` (silero's regions, beam 5): the same text, and
    the chunk's bounds within 0.1 s; without packing the 30 s windows give two
    segments (must differ)."""
    faster_whisper = pytest.importorskip("faster_whisper", reason="needs the test extra")
    w, reference = whisper_and_faster
    options = dict(condition_on_previous_text=False)
    ours = whisper.transcribe(w, placed, temperature=0.0, **options)
    segments, _ = faster_whisper.BatchedInferencePipeline(reference).transcribe(
        placed, batch_size=8, **options)
    theirs = list(segments)
    assert ours.text == "".join(s.text for s in theirs).strip()
    assert len(ours.segments) == len(theirs) == 1
    assert abs(ours.segments[0].start - theirs[0].start) <= 0.1
    assert abs(ours.segments[0].end - theirs[0].end) <= 0.1
    windows = whisper.transcribe(w, placed, temperature=0.0, vad_filter=False, **options)
    assert [(s.start, s.end) for s in windows.segments] == [(0.0, 30.0), (30.0, 50.0)]


def test_no_speech_no_segments(whisper_and_faster):
    w, _ = whisper_and_faster
    noise = np.random.default_rng(3).normal(0, 1e-3, 45 * SR).astype(np.float32)
    for timestamps in (False, True):
        result = whisper.transcribe(w, noise, timestamps=timestamps, vad_filter=True, **GREEDY)
        assert result.segments == () and result.text == ""


@pytest.mark.parametrize("options, message", [
    (dict(vad_filter="yes"), "vad_filter must be None, True or False"),
    (dict(vad_filter=True, clip_timestamps="1,2"), "clip_timestamps or vad_filter, not both"),
    (dict(vad_filter=True, word_timestamps=True, hallucination_silence_threshold=1.0),
     "hallucination_silence_threshold re-seeks windows"),
])
def test_bad_options_are_named(options, message, whisper_and_faster):
    with pytest.raises(ValueError, match=message):
        whisper.transcribe(whisper_and_faster[0], np.zeros(SR, np.float32), **options)

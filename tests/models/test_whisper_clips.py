"""`clip_timestamps` (decode only stretches of a file) against faster-whisper's on the
same CTranslate2 files (greedy): the same text and segment boundaries for each set of
clips on two sentences with a pause; the clips change the result (must differ);
bad clips are refused by name."""

import numpy as np
import pytest

from jaxformer.models import whisper

FOX = "tests/data/fox_espeak.wav"
SR = whisper.SAMPLE_RATE


@pytest.fixture(scope="module")
def audio():
    """The clip, 1.3 s of quiet noise, the clip at a lower gain (about 8 s)."""
    fox, rng = whisper.read_wav(FOX), np.random.default_rng(1)
    signal = np.concatenate([fox, np.zeros(int(1.3 * SR), np.float32), 0.7 * fox])
    return (signal + rng.normal(0, 1e-3, len(signal))).astype(np.float32)


@pytest.fixture(scope="module")
def whole(whisper_and_faster, audio):
    """The texts of the segments of the whole file."""
    result = whisper.transcribe(whisper_and_faster[0], audio, timestamps=True, temperature=0.0,
                                beam_size=1, condition_on_previous_text=False)
    return [s.text for s in result.segments]


@pytest.mark.parametrize("clips", ["4.6", "1.2,3.6,4.6,7"], ids=["second-to-end", "two-clips"])
def test_clips_are_faster_whispers(clips, whisper_and_faster, audio, whole):
    w, reference = whisper_and_faster
    ours = whisper.transcribe(w, audio, timestamps=True, temperature=0.0, beam_size=1,
                              condition_on_previous_text=False, clip_timestamps=clips)
    segments, _ = reference.transcribe(audio, beam_size=1, temperature=0.0,
                                       condition_on_previous_text=False,
                                       clip_timestamps=clips)
    theirs = [(round(s.start, 2), round(s.end, 2), s.text.strip()) for s in segments]
    assert [(round(s.start, 2), round(s.end, 2), s.text) for s in ours.segments] == theirs
    assert [s.text for s in ours.segments] != whole


@pytest.mark.parametrize("clips, message", [
    ("3,1", "each clip's end after its start: 3 then 1"),
    ("0,2,1", "in order"),
    ("-1", "finite seconds >= 0"),
    ("a,b", "seconds 'start,end,start,end,...'"),
])
def test_bad_clips_are_named(clips, message, whisper_and_faster):
    w, _ = whisper_and_faster
    with pytest.raises(ValueError, match=message):
        whisper.transcribe(w, np.zeros(SR, np.float32), clip_timestamps=clips)

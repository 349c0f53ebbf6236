"""Audio and video containers through PyAV (`jaxformer.models.whisper.media`): the
committed clip converted here to MP3, FLAC, M4A and MP4 (with a video stream),
transcribed as faster-whisper transcribes them (same CTranslate2 files, greedy), the
samples equal to faster-whisper's `decode_audio`, read as a stream in bounded
memory, and bad files refused in one line."""

import os

import numpy as np
import pytest

av = pytest.importorskip("av", reason="needs the media extra: pip install 'jaxformer[media]'")

from jaxformer.errors import FileFormatError  # noqa: E402
from jaxformer.models import whisper  # noqa: E402

from model_files import whisper_model_dir  # noqa: E402

FOX = os.path.join(os.path.dirname(__file__), os.pardir, "data", "fox_espeak.wav")
# container -> (file name, audio codec, video codec or None)
CONTAINERS = {"mp3": ("fox.mp3", "mp3", None), "flac": ("fox.flac", "flac", None),
              "m4a": ("fox.m4a", "aac", None), "mp4": ("fox.mp4", "aac", "mpeg4")}


def encode(path, samples_N, codec, video=None, rate=16000):
    """Write float samples in [-1, 1] as `codec` in the container `path` names, with a
    few black frames of `video` (a screen recording) when given."""
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=rate if codec != "mp3" else 22050, layout="mono")
        picture = None
        if video:
            picture = out.add_stream(video, rate=10)
            picture.width, picture.height, picture.pix_fmt = 64, 48, "yuv420p"
            for i in range(int(10 * len(samples_N) / rate)):
                frame = av.VideoFrame(64, 48, "yuv420p")
                for plane in frame.planes:
                    plane.update(bytes(plane.buffer_size))
                frame.pts = i
                out.mux(picture.encode(frame))
            out.mux(picture.encode(None))
        resampler = av.AudioResampler(format=stream.format.name, layout="mono",
                                      rate=stream.rate)
        pcm = (np.clip(samples_N, -1, 1) * 32767).astype(np.int16)[None]
        frame = av.AudioFrame.from_ndarray(pcm, format="s16", layout="mono")
        frame.sample_rate = rate
        for resampled in resampler.resample(frame) + resampler.resample(None):
            out.mux(stream.encode(resampled))
        out.mux(stream.encode(None))
    return str(path)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    directory = tmp_path_factory.mktemp("media")
    fox = whisper.read_wav(FOX)
    return {kind: encode(directory / name, fox, codec, video)
            for kind, (name, codec, video) in CONTAINERS.items()}


@pytest.fixture(scope="module")
def models(whisper_and_faster):
    """(jaxformer's Whisper, faster-whisper's model): conftest's, loaded once."""
    return whisper_and_faster


@pytest.mark.parametrize("kind", list(CONTAINERS))
def test_containers_give_faster_whispers_text_and_segments(kind, clips, models):
    w, reference = models
    ours = whisper.transcribe(w, clips[kind], timestamps=True, beam_size=1)
    segments, info = reference.transcribe(clips[kind], beam_size=1, temperature=0.0,
                                          condition_on_previous_text=False)
    theirs = list(segments)
    assert ours.text == "".join(s.text for s in theirs).strip()
    assert [(round(s.start, 2), round(s.end, 2)) for s in ours.segments] == [
        (round(s.start, 2), round(s.end, 2)) for s in theirs]
    assert "lazy" in ours.text and info.language == ours.language == "en"  # AAC: "lazy nog"


@pytest.mark.parametrize("kind", ["mp3", "mp4"])
def test_samples_equal_faster_whispers_decode_audio(kind, clips):
    faster_whisper = pytest.importorskip("faster_whisper", reason="needs the test extra")
    expected = faster_whisper.decode_audio(clips[kind], sampling_rate=16000)
    np.testing.assert_array_equal(whisper.read_media(clips[kind]), expected)


def test_a_long_file_is_read_as_a_stream_in_pieces(tmp_path):
    """70 s of FLAC read window by window as the pipeline reads it: the pieces equal
    the whole signal, and at most one window (plus one decoded frame) is kept."""
    fox = whisper.read_wav(FOX)
    signal = np.concatenate([np.tile(np.concatenate([fox, np.zeros(16000, np.float32)]), 15),
                             fox])[:16000 * 70]
    path = encode(tmp_path / "long.flac", signal, "flac")
    whole = whisper.read_media(path)
    source = whisper.open_media(path)
    assert source.num_samples == len(whole) == len(signal)
    step, kept = whisper.CHUNK_SAMPLES // 2, []
    for start in range(0, source.num_samples, step):
        np.testing.assert_array_equal(source.read(start, start + whisper.CHUNK_SAMPLES),
                                      whole[start:start + whisper.CHUNK_SAMPLES])
        kept.append(len(source.kept_N))
    assert max(kept) <= whisper.CHUNK_SAMPLES + 16384, kept
    np.testing.assert_array_equal(source.read(0, 100), whole[:100])  # going back: again


def test_a_video_without_audio_and_a_corrupt_file_are_one_line_each(tmp_path, clips):
    with av.open(str(tmp_path / "silent.mp4"), "w") as out:
        picture = out.add_stream("mpeg4", rate=10)
        picture.width, picture.height, picture.pix_fmt = 64, 48, "yuv420p"
        for i in range(5):
            frame = av.VideoFrame(64, 48, "yuv420p")
            frame.pts = i
            out.mux(picture.encode(frame))
        out.mux(picture.encode(None))
    with pytest.raises(FileFormatError, match=r"silent.mp4: has no audio stream \(streams: "
                                              r"video\)") as info:
        whisper.read_audio(str(tmp_path / "silent.mp4"))
    assert len(str(info.value).splitlines()) == 1
    data = open(clips["m4a"], "rb").read()
    (tmp_path / "cut.m4a").write_bytes(data[:len(data) // 3])  # the index is at the end
    (tmp_path / "noise.mp3").write_bytes(np.random.default_rng(0).bytes(4000))
    for name in ("cut.m4a", "noise.mp3"):
        with pytest.raises(FileFormatError, match=rf"{name}: (is not an audio or video file "
                                                  rf"FFmpeg can read|could not be decoded|has "
                                                  rf"no audio stream)") as info:
            whisper.read_audio(str(tmp_path / name))
        assert len(str(info.value).splitlines()) == 1


def test_the_cli_reads_an_mp3_and_refuses_a_video_without_audio(tmp_path, clips, capsys):
    from jaxformer.cli.main import main  # noqa: PLC0415

    assert main(["transcribe", "--model", whisper_model_dir(), clips["mp3"],
                 "--no-progress"]) == 0
    assert "lazy dog" in capsys.readouterr().out
    (tmp_path / "empty.mp4").write_bytes(b"")
    assert main(["transcribe", "--model", whisper_model_dir(), str(tmp_path / "empty.mp4"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "empty.mp4" in err and "Traceback" not in err

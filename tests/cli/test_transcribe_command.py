"""`jaxformer transcribe` end to end on the installed Whisper tiny: the text of a
44.1 kHz stereo file equals ctranslate2's text of the 16 kHz mono original; bad
options and files are one line and exit 2 before the model loads."""

import json
import os

import numpy as np
import pytest

from jaxformer.cli.main import main
from jaxformer.models import whisper

from conftest import REPO, whisper_ct2_runtime
from model_files import whisper_model_dir

FOX = os.path.join(REPO, "tests", "data", "fox_espeak.wav")
FOX_44K = os.path.join(REPO, "tests", "data", "fox_espeak_44k_stereo.wav")


@pytest.fixture(scope="module")
def ct2_text():
    """ctranslate2's text of the 16 kHz mono clip (English-only prompt), beam size 5 as
    `transcribe` decodes by default (faster-whisper's default)."""
    import ctranslate2  # noqa: PLC0415 (whisper_ct2_runtime skips without it)

    model_dir = whisper_model_dir()
    runtime = whisper_ct2_runtime(model_dir)
    vocab = whisper.load_ct2(model_dir)[2]
    features = whisper.features_of(whisper.read_wav(FOX))[None]
    storage = ctranslate2.StorageView.from_array(np.ascontiguousarray(
        features.transpose(0, 2, 1)))
    ids = runtime.generate(storage, [whisper.prompt_ids(vocab, None)], beam_size=5)
    return whisper.decode_text(vocab, ids[0].sequences_ids[0]).strip()


def test_json_lines_of_a_44k_stereo_file(ct2_text, capsys):
    assert main(["transcribe", "--model", whisper_model_dir(), FOX_44K, FOX, "--json",
                 "--no-progress"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["file"] for line in lines] == [FOX_44K, FOX]
    assert lines[0]["text"] == lines[1]["text"] == ct2_text
    assert lines[0]["language"] == "en" and lines[0]["language_probability"] is None
    assert lines[0]["segments"][0]["start"] == 0.0


@pytest.mark.parametrize("flags, message", [
    (["--language", "xx"], "xx"),
    (["--task", "translate"], "English-only"),
    (["--format", "srt"], "--format srt needs --timestamps"),
    (["--batch", "0"], "--batch: must be a positive integer"),
    (["--task", "translate", "--language", "en"], "English-only"),
    (["--no-speech-threshold", "1.5"], "--no-speech-threshold: no_speech_threshold is a "
                                       "probability in [0, 1]"),
    (["--logprob-threshold", "0.5"], "--logprob-threshold: logprob_threshold is a "
                                     "log-probability"),
    (["--compression-ratio-threshold", "0"], "--compression-ratio-threshold: "),
    (["--temperature", "0,-0.2"], "--temperature: temperatures must be finite numbers >= 0"),
    (["--temperature", "0.4,0.2"], "--temperature: temperatures must not decrease"),
    (["--temperature", "hot"], "--temperature: must be numbers separated by commas"),
    (["--logprob-threshold", "nan"], "--logprob-threshold: must be a finite number"),
    (["--best-of", "0"], "--best-of: must be a positive integer"),
    (["--beam-size", "0"], "--beam-size: must be a positive integer"),
    (["--patience", "0"], "--patience: must be a positive finite number"),
    (["--length-penalty", "nan"], "argument --length-penalty: must be a finite number"),
    (["--initial-prompt", "  "], "--initial-prompt: empty text"),
    (["--format", "tsv"], "--format tsv needs --timestamps"),
    (["--timestamps", "--format", "vtt", "--highlight-words"],
     "--highlight-words needs --word-timestamps"),
    (["--word-timestamps", "--json", "--max-line-width", "40"],
     "--max-line-width shapes subtitles: it needs --format srt, vtt or all"),
    (["--word-timestamps", "--format", "srt", "--max-line-count", "2"],
     "--max-line-count needs --max-line-width"),
    (["--word-timestamps", "--format", "srt", "--max-words-per-line", "0"],
     "--max-words-per-line: must be a positive integer"),
    (["--hallucination-silence-threshold", "2"],
     "--hallucination-silence-threshold needs --word-timestamps"),
    (["--word-timestamps", "--hallucination-silence-threshold", "-1"],
     "--hallucination-silence-threshold: seconds >= 0, got -1"),
    (["--word-timestamps", "--hallucination-silence-threshold", "inf"],
     "--hallucination-silence-threshold: must be a finite number"),
    (["--clip-timestamps", "5,2"], "--clip-timestamps: clip_timestamps must be in order"),
    (["--vad-filter", "--clip-timestamps", "0,2"],
     "give --clip-timestamps or --vad-filter, not both"),
    (["--vad-filter", "--word-timestamps", "--hallucination-silence-threshold", "1"],
     "--hallucination-silence-threshold re-seeks windows, and --vad-filter"),
], ids=["language", "translate-english-only", "srt-without-timestamps", "batch",
        "translate-named-english", "no-speech", "logprob", "ratio", "negative-temperature",
        "decreasing-temperatures", "temperature-word", "nan", "best-of", "beam-size",
        "patience", "length-penalty", "empty-prompt", "tsv-without-timestamps",
        "highlight-without-words", "width-in-json", "count-without-width", "zero-words",
        "hallucination-without-words", "negative-silence", "infinite-silence",
        "clips-out-of-order", "vad-and-clips", "vad-and-hallucination"])
def test_bad_options_are_one_line_and_exit_2(flags, message, capsys):
    assert main(["transcribe", "--model", whisper_model_dir(), FOX, *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_initial_prompt_is_the_librarys(capsys):
    """The flags reach `whisper.transcribe`: the JSON text is the library's with the
    same prompt, and differs from the text without it (the prompt is read)."""
    from jaxformer.models import whisper  # noqa: PLC0415

    prompt = "Jumping foxes and sleepy dogs."
    assert main(["transcribe", "--model", whisper_model_dir(), FOX, "--json", "--no-progress",
                 "--timestamps", "--initial-prompt", prompt, "--temperature", "0",
                 "--no-condition-on-previous-text"]) == 0
    line = json.loads(capsys.readouterr().out)
    w = whisper.load(whisper_model_dir())
    expected = whisper.transcribe(w, FOX, timestamps=True, temperature=0.0,
                                  initial_prompt=prompt, condition_on_previous_text=False)
    assert line["text"] == expected.text
    assert line["text"] != whisper.transcribe(w, FOX, timestamps=True, temperature=0.0).text


def test_an_unknown_language_is_refused_before_the_model_is_read(monkeypatch, capsys):
    from jaxformer.models import whisper  # noqa: PLC0415

    def no_load(*args, **kwargs):
        raise AssertionError("the model was read before --language was checked")

    monkeypatch.setattr(whisper, "load", no_load)
    assert main(["transcribe", "--model", whisper_model_dir(), FOX, "--language", "english"]) == 2
    err = capsys.readouterr().err
    assert "--language: unknown language 'english'" in err and len(err.strip().splitlines()) == 1


def test_whisper_language_codes_are_transformers():
    """The fixed list is transformers' Whisper LANGUAGES, in vocabulary order."""
    tokenization = pytest.importorskip("transformers.models.whisper.tokenization_whisper",
                                       reason="transformers (the test extra) has the list")
    from jaxformer.models import whisper  # noqa: PLC0415

    assert whisper.LANGUAGE_CODES == tuple(tokenization.LANGUAGES)


def test_a_file_that_is_not_audio_is_named(tmp_path, capsys):
    not_audio = tmp_path / "notes.wav"
    not_audio.write_text("hello")
    assert main(["transcribe", "--model", whisper_model_dir(), FOX, str(not_audio)]) == 2
    err = capsys.readouterr().err
    assert str(not_audio) in err and len(err.strip().splitlines()) == 1, err
    assert main(["transcribe", "--model", str(tmp_path), FOX]) == 2  # no model files
    err = capsys.readouterr().err
    assert str(tmp_path) in err and len(err.strip().splitlines()) == 1, err


def test_an_empty_or_silent_wav_is_an_empty_transcript(tmp_path, capsys):
    import wave  # noqa: PLC0415

    paths = []
    for name, seconds in (("empty.wav", 0), ("silence.wav", 70)):
        with wave.open(str(tmp_path / name), "wb") as f:
            f.setnchannels(1), f.setsampwidth(2), f.setframerate(16000)
            f.writeframes(bytes(2 * 16000 * seconds))
        paths.append(str(tmp_path / name))
    assert main(["transcribe", "--model", whisper_model_dir(), *paths, "--json",
                 "--no-progress"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(line["text"], line["segments"]) for line in lines] == [("", []), ("", [])]


def test_status_lines_come_at_a_low_rate_without_a_terminal():
    import io  # noqa: PLC0415

    from jaxformer.cli.transcribe import StatusLines  # noqa: PLC0415

    now, out = [0.0], io.StringIO()
    status = StatusLines(every=10.0, clock=lambda: now[0], file=out)
    for second in range(1, 36):  # a call every second for 35 s
        now[0] = float(second)
        status(second * 100.0, 3600.0)
    lines = out.getvalue().splitlines()
    assert lines == ["jaxformer transcribe: 1000/3600 s of audio (28%), 10 s",
                     "jaxformer transcribe: 2000/3600 s of audio (56%), 20 s",
                     "jaxformer transcribe: 3000/3600 s of audio (83%), 30 s"]
    status(3600.0, 3600.0)  # done: the results follow, no line
    now[0] = 100.0
    status(3600.0, 3600.0)
    assert len(out.getvalue().splitlines()) == 3


def made_transcript(monkeypatch):
    """A transcript with words that `whisper.transcribe` returns for every file (the
    model is not read), and the options it was called with."""
    words = tuple(whisper.Word(w, 0.3 * i, 0.3 * i + 0.25, 0.9)
                  for i, w in enumerate([" The", " quick", " brown", " fox", " jumps."]))
    result = whisper.Transcript("The quick brown fox jumps.", "en", None,
                                (whisper.Segment(0.0, 1.5, "The quick brown fox jumps.",
                                                 words),))
    monkeypatch.setattr(whisper, "load", lambda path, **kw: object())
    monkeypatch.setattr(whisper, "check_options", lambda *args: None)
    seen = {}

    def fake_transcribe(w, samples, **options):
        seen.update(options)
        return [result] * len(samples)

    monkeypatch.setattr(whisper, "transcribe", fake_transcribe)
    return result, seen


def test_format_all_writes_each_file_once(tmp_path, monkeypatch, capsys):
    """--format all --output-dir: one file per format, each what stdout would print;
    a second run is refused before decoding and leaves the files as they were; two
    inputs with one name, and all without a directory, are refused."""
    result, seen = made_transcript(monkeypatch)
    out_dir = tmp_path / "out"
    flags = ["transcribe", "--model", whisper_model_dir(), "--word-timestamps",
             "--no-progress", "--format", "all", "--max-line-width", "12", FOX]
    assert main([*flags, "--output-dir", str(out_dir)]) == 0
    assert capsys.readouterr().out == ""
    files = {p.name: p.read_text(encoding="utf-8") for p in out_dir.iterdir()}
    assert files == {"fox_espeak.txt": whisper.to_text(result, True) + "\n",
                     "fox_espeak.json": json.dumps({"file": FOX, **result.to_dict()}) + "\n",
                     "fox_espeak.srt": whisper.srt(result.segments, max_line_width=12),
                     "fox_espeak.vtt": whisper.vtt(result.segments, max_line_width=12),
                     "fox_espeak.tsv": whisper.tsv(result.segments)}
    seen.clear()
    (out_dir / "fox_espeak.srt").write_text("mine", encoding="utf-8")
    assert main([*flags, "--output-dir", str(out_dir)]) == 2
    err = capsys.readouterr().err
    assert "fox_espeak.txt exists (never overwritten" in err and len(err.splitlines()) == 1
    assert seen == {} and (out_dir / "fox_espeak.srt").read_text(encoding="utf-8") == "mine"
    assert main([*flags, os.path.join(str(tmp_path), "fox_espeak.wav"), "--output-dir",
                 str(tmp_path / "other")]) == 2  # two files named fox_espeak
    assert "would both write" in capsys.readouterr().err
    assert main(flags) == 2
    assert "--format all writes one file per format: it needs --output-dir" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("fmt, flags, layout", [
    ("vtt", ["--max-line-width", "12", "--max-line-count", "1"],
     {"max_line_width": 12, "max_line_count": 1}),
    ("srt", ["--highlight-words", "--max-words-per-line", "2"],
     {"highlight_words": True, "max_words_per_line": 2}),
    ("tsv", [], None),
], ids=["vtt-width-count", "srt-highlight-words", "tsv"])
def test_subtitle_flags_reach_the_writers(fmt, flags, layout, monkeypatch, capsys):
    """The CLI prints `whisper.vtt/srt(segments, **layout)` (tested against
    openai-whisper's writers in tests/models/test_whisper_subtitles.py) or
    `whisper.tsv`, and the layout changes the cues; the model is replaced by a
    made transcript (the flags, not the decoding, are under test)."""
    result, seen = made_transcript(monkeypatch)
    assert main(["transcribe", "--model", whisper_model_dir(), FOX, "--format", fmt,
                 "--word-timestamps", "--no-progress", "--hallucination-silence-threshold",
                 "1.5", "--clip-timestamps", "0,20", *flags]) == 0
    out = capsys.readouterr().out
    assert seen["word_timestamps"] is True and seen["hallucination_silence_threshold"] == 1.5
    assert seen["clip_timestamps"] == "0,20" and seen["vad_filter"] is None
    if layout is None:
        assert out == whisper.tsv(result.segments)
        assert out.splitlines()[1] == "0\t1500\tThe quick brown fox jumps."
        return
    writer = getattr(whisper, fmt)
    assert out == writer(result.segments, **layout) != writer(result.segments)


@pytest.mark.parametrize("flags, expected", [([], None), (["--vad-filter"], True),
                                             (["--no-vad-filter"], False)],
                         ids=["default", "on", "off"])
def test_vad_filter_reaches_the_library(flags, expected, monkeypatch, capsys):
    """--vad-filter / --no-vad-filter reach `whisper.transcribe(vad_filter=...)`, the
    default None (the library's rule: tests/models/test_whisper_speech.py)."""
    _, seen = made_transcript(monkeypatch)
    assert main(["transcribe", "--model", whisper_model_dir(), FOX, "--no-progress",
                 *flags]) == 0
    assert seen["vad_filter"] is expected

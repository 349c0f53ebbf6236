"""SRT, WebVTT and TSV (`jaxformer.models.whisper.subtitles`) against openai-whisper's
own writers (`whisper/utils.py`: WriteSRT, WriteVTT, WriteTSV, called on our
`Transcript.to_dict()`), with and without word timestamps, for each word layout
option; and the layout options refused by name. No model runs: the transcripts are
made here (a long pause, a segment without words, "-->" and a tab in the text)."""

import importlib.util
import io
import os

import pytest

from jaxformer.models import whisper


def openai_utils():
    """openai-whisper's `utils.py`, loaded alone (its package imports numba and torch;
    `pip install --no-deps openai-whisper==20250625` is enough for this file)."""
    spec = importlib.util.find_spec("whisper")
    path = (os.path.join(spec.submodule_search_locations[0], "utils.py")
            if spec and spec.submodule_search_locations else "")
    if not os.path.isfile(path):
        pytest.skip("needs openai-whisper (pip install --no-deps openai-whisper==20250625)")
    module_spec = importlib.util.spec_from_file_location("openai_whisper_utils", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference():
    return openai_utils()


def segment(start, end, text, words=None):
    return whisper.Segment(start, end, text, None if words is None else tuple(
        whisper.Word(word, a, b, 0.9) for word, a, b in words))


def transcript(with_words: bool) -> whisper.Transcript:
    """Three segments: short words, one after a 4 s pause, a long sentence, a segment
    whose words are all gone; times past an hour."""
    rows = [
        (0.0, 2.5, " Hello there, world.", [(" Hello", 0.1, 0.5), (" there,", 0.5, 0.9),
                                            (" world.", 2.0, 2.4)]),
        (6.0, 12.0, " A --> arrow\tand a much longer sentence follows here.",
         [(" A", 6.5, 6.7), (" -->", 6.7, 6.9), (" arrow", 6.9, 7.3), (" and", 7.3, 7.4),
          (" a", 7.4, 7.5), (" much", 7.5, 7.9), (" longer", 7.9, 8.4),
          (" sentence", 8.4, 9.0), (" follows", 9.0, 9.6), (" here.", 9.6, 11.8)]),
        (20.0, 21.0, " Hm.", []),
        (3599.5, 3601.25, " Past the hour.", [(" Past", 3599.6, 3600.0),
                                               (" the", 3600.0, 3600.4),
                                               (" hour.", 3600.4, 3601.2)]),
    ]
    segments = tuple(segment(a, b, text, words if with_words else None)
                     for a, b, text, words in rows)
    return whisper.Transcript("".join(s.text for s in segments).strip(), "en", None, segments)


LAYOUTS = {
    "segments": {},
    "highlight": {"highlight_words": True},
    "width": {"max_line_width": 16},
    "width-and-count": {"max_line_width": 16, "max_line_count": 2},
    "width-count-highlight": {"max_line_width": 12, "max_line_count": 1,
                              "highlight_words": True},
    "words-per-line": {"max_words_per_line": 3},
    "one-word": {"max_words_per_line": 1, "highlight_words": True},
}


def written(writer, result: dict, **layout) -> str:
    out = io.StringIO()
    writer.write_result(result, out, **layout)
    return out.getvalue()


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("fmt", ["srt", "vtt"])
def test_word_cues_are_openai_whispers(fmt, layout, reference):
    result = transcript(with_words=True)
    writer = {"srt": reference.WriteSRT, "vtt": reference.WriteVTT}[fmt](".")
    ours = getattr(whisper, fmt)(result.segments, **LAYOUTS[layout])
    assert ours == written(writer, result.to_dict(), **LAYOUTS[layout])


@pytest.mark.parametrize("fmt", ["srt", "vtt", "tsv"])
def test_segment_cues_and_tsv_are_openai_whispers(fmt, reference):
    result = transcript(with_words=False)
    writer = {"srt": reference.WriteSRT, "vtt": reference.WriteVTT,
              "tsv": reference.WriteTSV}[fmt](".")
    assert getattr(whisper, fmt)(result.segments) == written(writer, result.to_dict())


def test_the_layouts_differ():
    """Must-differ: each option changes the cues of the same words."""
    segments = transcript(with_words=True).segments
    outputs = {name: whisper.vtt(segments, **layout) for name, layout in LAYOUTS.items()}
    assert len(set(outputs.values())) == len(outputs)
    assert "<u>Hello</u> there," in outputs["highlight"]
    assert whisper.tsv(segments).splitlines()[:2] == ["start\tend\ttext",
                                                      "0\t2500\tHello there, world."]


@pytest.mark.parametrize("layout, message", [
    ({"max_line_width": 0}, "max_line_width must be a positive integer"),
    ({"max_words_per_line": 2.5}, "max_words_per_line must be a positive integer"),
    ({"max_line_count": 2}, "max_line_count needs max_line_width"),
], ids=["zero-width", "float-words", "count-without-width"])
def test_bad_layouts_are_named(layout, message):
    with pytest.raises(ValueError, match=message):
        whisper.srt(transcript(with_words=True).segments, **layout)

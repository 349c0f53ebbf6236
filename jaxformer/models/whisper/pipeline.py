"""Audio to text with Whisper: any WAV (any audio or video file with PyAV), any
length, language detection, translation, segment timestamps.

    w = whisper.load(model_dir)         # a CTranslate2 Whisper folder or a Hugging Face one
    result = whisper.transcribe(w, "talk.mp3", timestamps=True)
    result.text, result.language, result.language_probability, result.segments
    print(whisper.srt(result.segments))

Audio longer than 30 s is decoded in 30 s windows. Without timestamps the
windows are consecutive and independent, so the windows of every file are
decoded together, `batch_size` rows at a time. With timestamps each window
starts where the previous one's last complete segment ended (openai-whisper's
`transcribe`: a sentence cut by the window edge is decoded again whole), so a
file's windows are sequential, and the current windows of several files form
a batch. Batches are padded to a fixed number of rows so that one compiled
program serves every batch of a run. With speech packing (`vad_filter`, as
faster-whisper's batched pipeline), each file's speech is joined into chunks of
at most 30 s (`speech`) and the chunks of every file are decoded once each,
together, their times mapped back to the file (`windows.packed_windows`).

Decoding is beam search at temperature 0 (`beam_size` 5 as faster-whisper; 1:
greedy) with Whisper's prompts and logits processors (`generate`), with
openai-whisper's temperature fallback (`fallback`), an initial prompt and
conditioning on the previous windows' text (`prompt`), and word timestamps
(`words`).
"""


from __future__ import annotations

import math
import os
from typing import Callable, Optional, Sequence, Union

import numpy as np

from jaxformer.errors import FileFormatError
from jaxformer.models.whisper import audio as audio_lib
from jaxformer.models.whisper import media
from jaxformer.models.whisper import speech
from jaxformer.models.whisper.checkpoint import Whisper
from jaxformer.models.whisper.beam import check_beam
from jaxformer.models.whisper.fallback import TEMPERATURES, Safeguards
from jaxformer.models.whisper.features import HOP
from jaxformer.models.whisper.hallucination import check_threshold
from jaxformer.models.whisper.decoding import detect_language
from jaxformer.models.whisper.output import Segment, Transcript
from jaxformer.models.whisper.prompt import Context, PromptInput, encode_text
from jaxformer.models.whisper.words import alignment_heads
from jaxformer.models.whisper.tokens import TASKS, Tokens, decode_text, prompt_ids, tokens_of
from jaxformer.models.whisper.windows import (FRAMES_PER_SECOND, WINDOW_FRAMES, Windows,
                                              consecutive_windows, packed_windows, padded_rows,
                                              seek_windows, window_features)

AudioInput = Union[str, os.PathLike, np.ndarray, audio_lib.WavFile, audio_lib.Samples,
                   media.MediaFile]


def check_options(w: Whisper, language: str, task: str) -> Tokens:
    """ValueError naming a bad language, task, or a combination the model cannot do."""
    t = tokens_of(list(w.vocab))
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if language != "auto":
        t.language_id(language)
    if not w.multilingual and (language not in ("auto", "en") or task != "transcribe"):
        raise ValueError(f"this is an English-only Whisper model ({len(w.vocab)} tokens): it "
                         f"transcribes English only (got language={language!r}, task={task!r})")
    return t


def check_thresholds(no_speech_threshold, logprob_threshold) -> None:
    """ValueError unless each is None or a finite number (no_speech_threshold in [0, 1],
    logprob_threshold <= 0): `fallback.Safeguards.check`."""
    Safeguards(no_speech_threshold=no_speech_threshold, logprob_threshold=logprob_threshold)


def read_audio(item: AudioInput):
    """A source of 16 kHz mono samples read window by window, checked now: a WAV path
    (a RIFF/WAVE header or a .wav name; any rate and channels; the samples are read
    as they are needed: `audio.open_wav`), any other audio or video file through
    PyAV (the `media` extra:
    `media.open_media`, decoded as a stream), a `WavFile` or `MediaFile`, or (N,)
    samples (`audio.Samples`)."""
    if isinstance(item, (audio_lib.WavFile, audio_lib.Samples, media.MediaFile)):
        return item
    if isinstance(item, (str, os.PathLike)):
        path = os.fspath(item)
        if os.path.isfile(path) and not media.is_wav(path) and not path.lower().endswith(
                (".wav", ".wave")):
            try:
                return media.open_media(path)
            except ImportError:
                raise FileFormatError(path, "is not a WAV file, and other audio or video "
                                            "formats are read with PyAV, which is not installed",
                                      "pip install 'jaxformer[media]'") from None
        return audio_lib.open_wav(path)
    return audio_lib.Samples(item)


def transcribe(w: Whisper, audio: Union[AudioInput, Sequence[AudioInput]], *,
               language: str = "auto", task: str = "transcribe", timestamps: bool = False,
               batch_size: int = 8, max_text_tokens: int = 224,
               no_speech_threshold: Optional[float] = 0.6,
               logprob_threshold: Optional[float] = -1.0,
               temperature: Union[float, Sequence[float]] = TEMPERATURES,
               compression_ratio_threshold: Optional[float] = 2.4, best_of: int = 5,
               beam_size: int = 5, patience: float = 1.0, length_penalty: float = 1.0,
               initial_prompt: PromptInput = None, condition_on_previous_text: bool = True,
               word_timestamps: bool = False,
               hallucination_silence_threshold: Optional[float] = None,
               clip_timestamps: Union[str, Sequence[float], None] = None,
               vad_filter: Optional[bool] = None,
               progress: Optional[Callable[[float, float], None]] = None
               ) -> Union[Transcript, list[Transcript]]:
    """Transcribe (or translate to English) one audio input or a list of them.

    Files are read window by window (`audio.open_wav`): memory does not grow
    with their length. Two rules leave a window without text, so silence gives
    an empty transcript (an empty file too) rather than invented words:

    - a window with no sample above one 16-bit step (`audio.is_silent`:
      digital silence, such as zeros) is skipped without running the model;
    - Whisper's no-speech rule (openai-whisper's `transcribe`): a decoded window
      whose probability of <|nospeech|> after <|startoftranscript|> is above
      `no_speech_threshold` and whose average log-probability is below
      `logprob_threshold` is dropped (None turns a test off; both None keep
      every window).

    Before that rule, a window whose text is a loop (gzip compression ratio
    above `compression_ratio_threshold`) or improbable (average log-probability
    below `logprob_threshold`) is decoded again at the next of `temperature`
    (sampling, the most probable of `best_of`), as openai-whisper and
    faster-whisper do (`fallback`); `temperature=0.0` decodes greedily once.

    Args:
      w: `load(model_dir)`.
      audio: a path (WAV, or any audio or video file with the `media` extra:
        `read_audio`), an `audio.WavFile`, or (N,) float 16 kHz samples, or a
        list of these (then a list of results, in order).
      language: "auto" (detected per file on its first 30 s, from the language
        tokens: `detect_language`) or a code such as "en"; English-only
        models take "auto" or "en" and report "en" without a probability.
      task: "transcribe" or "translate" (to English; multilingual models).
      timestamps: decode segment timestamps (`<|0.00|>` tokens, Whisper's rules)
        and seek by the last complete segment; else one segment per 30 s window.
      batch_size: windows decoded together (at most).
      max_text_tokens: tokens generated per window at most (Whisper: 224).
      no_speech_threshold, logprob_threshold: the no-speech rule (0.6, -1.0 as
        openai-whisper).
      temperature, compression_ratio_threshold, best_of: the temperature fallback
        ((0.0, 0.2, ..., 1.0), 2.4, 5 as faster-whisper).
      beam_size, patience, length_penalty: beam search at temperature 0 as
        faster-whisper (CTranslate2) runs it (5, 1.0, 1.0): `beam_size` beams per
        window (1: greedy), round(beam_size * patience) finished hypotheses
        collected, the kept one the most probable by summed log-probability /
        length ** length_penalty (0: no normalisation).
      initial_prompt: text (encoded with the checkpoint's tokenizer.json, as
        faster-whisper: `prompt.encode_text`) or token ids given to the first
        window of each file after <|startofprev|> (names, spellings, style).
      condition_on_previous_text: each window's prompt holds the file's text so
        far (its last 223 tokens), reset after a window decoded above
        temperature 0.5 (faster-whisper's default: True). Then a file's windows
        are decoded one after another even without timestamps; False lets them
        be decoded together (`batch_size`).
      word_timestamps: each segment's `words` (word, start, end, probability), from
        the cross-attention of the checkpoint's alignment heads and DTW
        (`words`, as faster-whisper); implies `timestamps`.
      hallucination_silence_threshold: with word timestamps, seconds of silence
        around a likely hallucination (improbable, very short or very long words)
        that make it skipped, and the silence before it (`hallucination`, as
        faster-whisper and openai-whisper; None: off).
      clip_timestamps: the stretches of each file to decode, "start,end,start,end,..."
        in seconds (a string or numbers; the last end may be left out: the file's
        end), as openai-whisper's and faster-whisper's `clip_timestamps`: windows
        start inside a clip and their audio stops at its end (`parse_clips`).
      vad_filter: speech packing, as faster-whisper's `BatchedInferencePipeline`
        (`vad_filter`): each file's speech is found (`speech.speech_regions`, an
        energy detector with silero's rules, not silero's network), joined into
        chunks of at most 30 s (`speech.pack`), and the chunks of every file are
        decoded once each, together, `batch_size` at a time; segment (and word)
        times are mapped back to the file (`windows.packed_windows`). Chunks are
        independent: no conditioning on the previous text (an initial prompt is
        given to every chunk), no seeking (with timestamps, a segment cut by the
        chunk's end is left out, as faster-whisper's batched pipeline does). None
        (the default): on for a file over 30 s whose windows are decoded together
        anyway (no timestamps, no conditioning on the previous text, no clips:
        where faster-whisper's batched pipeline runs it by default), off
        otherwise; True: on for every file (not with `clip_timestamps` or
        `hallucination_silence_threshold`); False: off.
      progress: called as `progress(seconds done, seconds in total)` after each
        window skipped and each batch decoded.
    Raises:
      ValueError (an unknown language code, task, or an option the model cannot
      do) and FileFormatError (a file that is not audio, has no audio stream or is
      corrupt) before any decoding.
    """
    single = isinstance(audio, (str, os.PathLike, audio_lib.WavFile, audio_lib.Samples,
                                   media.MediaFile)) or (
        isinstance(audio, np.ndarray) and audio.ndim == 1)
    items = [audio] if single else list(audio)
    t = check_options(w, language, task)
    if batch_size < 1 or max_text_tokens < 1:
        raise ValueError(f"batch_size and max_text_tokens must be >= 1, got {batch_size}, "
                         f"{max_text_tokens}")
    safeguards = Safeguards(temperature, compression_ratio_threshold, logprob_threshold,
                            no_speech_threshold, best_of)
    check_beam(beam_size, patience, length_penalty)
    if not isinstance(condition_on_previous_text, bool):
        raise ValueError(f"condition_on_previous_text must be True or False, got "
                         f"{condition_on_previous_text!r}")
    initial = encode_text(w, initial_prompt)
    if not isinstance(word_timestamps, bool):
        raise ValueError(f"word_timestamps must be True or False, got {word_timestamps!r}")
    check_threshold(hallucination_silence_threshold)
    if hallucination_silence_threshold is not None and not word_timestamps:
        raise ValueError("hallucination_silence_threshold needs word_timestamps=True (the "
                         "rule reads the words' timing and probability)")
    clips = parse_clips(clip_timestamps)
    if vad_filter not in (None, True, False):
        raise ValueError(f"vad_filter must be None, True or False, got {vad_filter!r}")
    if vad_filter and clips is not None:
        raise ValueError("vad_filter=True finds the stretches to decode itself: give "
                         "clip_timestamps or vad_filter, not both")
    if vad_filter and hallucination_silence_threshold is not None:
        raise ValueError("hallucination_silence_threshold re-seeks windows, and vad_filter=True "
                         "decodes each chunk once: use one or the other")
    timestamps = timestamps or word_timestamps
    sources = [read_audio(item) for item in items]  # every file is checked first
    frames = [s.num_samples // HOP for s in sources]
    languages, probabilities = detect(w, t, sources, language, batch_size)
    prompts = [prompt_ids(list(w.vocab), lang if w.multilingual else None, task,
                                  timestamps) for lang in languages]
    context = None
    if initial_prompt is not None or (condition_on_previous_text and (timestamps or any(
            n > WINDOW_FRAMES for n in frames))):  # else every window's prompt is the same
        context = Context(w.vocab, [initial] * len(sources), bool(condition_on_previous_text))
    heads = alignment_heads(w.model_dir, w.model.config.num_decoder_layers,
                            w.model.config.num_heads) if word_timestamps else ()
    windows = Windows(w, sources, prompts, max_text_tokens, safeguards, context=context,
                      word_heads=heads, beam_size=beam_size,
                      hallucination_silence_threshold=hallucination_silence_threshold,
                      patience=patience, length_penalty=length_penalty)
    total = sum(frames) / FRAMES_PER_SECOND
    report = (lambda done: progress(done / FRAMES_PER_SECOND, total)) if progress else None
    sequential = bool(timestamps or context or clips)
    packed = [vad_filter if vad_filter is not None else (not sequential and n > WINDOW_FRAMES)
              for n in frames]
    if any(packed):
        if context is not None:  # chunks are independent: the initial prompt for each
            windows.context = Context(w.vocab, [initial] * len(sources), False)
        chunks = [speech.pack(speech.speech_regions(s)) if on else whole_windows(s.num_samples)
                  for s, on in zip(sources, packed)]
        segments = packed_windows(windows, chunks, t.timestamp_begin if timestamps else None,
                                  batch_size, report)
        if report:
            report(sum(frames))
    elif sequential:
        segments = seek_windows(windows, frames, t.timestamp_begin, batch_size, report, clips)
    else:
        segments = consecutive_windows(windows, frames, batch_size, report)
    results = []
    for lang, prob, segs in zip(languages, probabilities, segments):
        ids = [i for _, _, piece, *_ in segs for i in piece]
        texts = [decode_text(w.vocab, seg[2]).strip() for seg in segs]
        results.append(Transcript(
            decode_text(w.vocab, ids).strip(), lang, prob,
            tuple(Segment(round(seg[0], 3), round(seg[1], 3), text, *seg[3:])
                  for seg, text in zip(segs, texts) if text)))  # silence: no segment
    return results[0] if single else results


def whole_windows(num_samples: int) -> list[list[tuple[int, int]]]:
    """A file without speech packing as packed chunks: its consecutive 30 s windows
    (at least one), each a chunk of one region."""
    size = WINDOW_FRAMES * HOP
    return [[(start, min(start + size, num_samples))]
            for start in range(0, max(num_samples, 1), size)]


def parse_clips(clip_timestamps: Union[str, Sequence[float], None]
                ) -> Optional[list[tuple[int, Optional[int]]]]:
    """(first mel frame, end frame or None: the file's end) of each clip of
    "start,end,start,end,..." seconds, or None for the whole file.

    Raises:
      ValueError unless the times are finite, >= 0, each clip's end after its start,
      and each clip after the one before.
    """
    if clip_timestamps is None:
        return None
    text = clip_timestamps if isinstance(clip_timestamps, str) else None
    try:
        times = ([float(x) for x in text.split(",")] if text is not None
                 else [float(x) for x in clip_timestamps])
    except (TypeError, ValueError):
        raise ValueError(f"clip_timestamps must be seconds 'start,end,start,end,...', got "
                         f"{clip_timestamps!r}") from None
    if not times or not all(math.isfinite(x) and x >= 0 for x in times):
        raise ValueError(f"clip_timestamps must be finite seconds >= 0, got {clip_timestamps!r}")
    for i in range(1, len(times)):
        if times[i] <= times[i - 1] if i % 2 else times[i] < times[i - 1]:
            raise ValueError(f"clip_timestamps must be in order, each clip's end after its "
                             f"start: {times[i - 1]:g} then {times[i]:g}")
    frames = [round(x * FRAMES_PER_SECOND) for x in times]
    ends = frames[1::2] + [None] * (len(frames) % 2)
    return list(zip(frames[::2], ends))


def detect(w: Whisper, t: Tokens, sources: list, language: str,
           batch_size: int) -> tuple[list[str], list[Optional[float]]]:
    """Each file's language and its probability (None where not detected)."""
    if language != "auto" or not w.multilingual:
        return ["en" if language == "auto" else language] * len(sources), [None] * len(sources)
    rows = padded_rows(len(sources), batch_size)
    languages, probabilities = [], []
    for i in range(0, len(sources), rows):
        chunk = [window_features(s, 0, w.n_mels) for s in sources[i:i + rows]]
        features = np.stack(chunk + [chunk[0]] * (rows - len(chunk)))
        for code, p in detect_language(w.model, w.params, list(w.vocab),
                                               features)[:len(chunk)]:
            languages.append(code)
            probabilities.append(p)
    return languages, probabilities

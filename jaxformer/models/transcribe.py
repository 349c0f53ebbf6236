"""Audio to text with Whisper: any WAV, any length, language detection, translation,
segment timestamps, and SRT/JSON/text output.

    w = transcribe.load(model_dir)      # a CTranslate2 Whisper folder or a Hugging Face one
    result = transcribe.transcribe(w, "talk.wav", timestamps=True)
    result.text, result.language, result.language_probability, result.segments
    print(transcribe.srt(result.segments))

Audio longer than 30 s is decoded in 30 s windows. Without timestamps the
windows are consecutive and independent, so the windows of every file are
decoded together, `batch_size` rows at a time. With timestamps each window
starts where the previous one's last complete segment ended (openai-whisper's
`transcribe`: a sentence cut by the window edge is decoded again whole), so a
file's windows are sequential, and the current windows of several files form
a batch. Batches are padded to a fixed number of rows so that one compiled
program serves every batch of a run.

Decoding is greedy with Whisper's prompts and logits processors
(`whisper.generate_ids`); not included are openai-whisper's temperature
fallback, conditioning on the previous window's text, and word timestamps.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from jaxformer.models import audio as audio_lib
from jaxformer.models import whisper
from jaxformer.nn.model import Transformer

WINDOW_FRAMES = audio_lib.CHUNK_SAMPLES // audio_lib.HOP  # 3000 mel frames = 30 s
FRAMES_PER_SECOND = audio_lib.SAMPLE_RATE // audio_lib.HOP  # 100
FRAMES_PER_TOKEN = 2  # the encoder's second convolution has stride 2


@dataclasses.dataclass(frozen=True)
class Whisper:
    """A loaded Whisper checkpoint and its decoding conventions (`load`)."""

    model: Transformer
    params: Any
    vocab: tuple[str, ...]
    suppress_ids: tuple[int, ...]
    suppress_ids_begin: tuple[int, ...]
    multilingual: bool  # False: an English-only (".en") model, which neither detects nor translates


def load(model_dir: str, dtype: str = "float32") -> Whisper:
    """A CTranslate2 Whisper folder (`model.bin`, `vocabulary.txt`, `config.json`), or a
    Hugging Face WhisperForConditionalGeneration directory (`config.json`,
    safetensors, `tokenizer.json`; the suppressed tokens of `generation_config.json`)."""
    if not os.path.exists(os.path.join(model_dir, "model.bin")) and os.path.exists(
            os.path.join(model_dir, "config.json")) and "architectures" in whisper.special_ids(
                model_dir):
        return load_hf(model_dir, dtype)
    model, params, vocab = whisper.load_ct2(model_dir, dtype)
    special = whisper.special_ids(model_dir)
    return Whisper(model, params, tuple(vocab), tuple(special["suppress_ids"]),
                   tuple(special["suppress_ids_begin"]), whisper.tokens_of(vocab).multilingual)


def load_hf(model_dir: str, dtype: str = "float32") -> Whisper:
    """A Hugging Face WhisperForConditionalGeneration directory (`hf_encdec`)."""
    from jaxformer.errors import FileFormatError  # noqa: PLC0415
    from jaxformer.models import hf_encdec  # noqa: PLC0415 - optional readers

    values = hf_encdec.read_config(model_dir)
    if values.get("architectures", [None])[0] != hf_encdec.WHISPER:
        raise ValueError(f"{model_dir}: config.json architectures={values.get('architectures')}"
                         f", not {hf_encdec.WHISPER}")
    if int(values.get("num_mel_bins", 80)) != whisper.N_MELS or int(
            values.get("max_source_positions", 1500)) * 2 != WINDOW_FRAMES:
        raise ValueError(f"{model_dir}: transcription reads {whisper.N_MELS} mel bins over "
                         f"{WINDOW_FRAMES} frames; config.json has num_mel_bins="
                         f"{values.get('num_mel_bins')}, max_source_positions="
                         f"{values.get('max_source_positions')}")
    model, params, tokenizer = hf_encdec.load_hf_encdec(model_dir, dtype=dtype, values=values)
    if tokenizer is None:
        raise FileFormatError(os.path.join(model_dir, "tokenizer.json"), "is missing",
                              "transcription needs the Whisper vocabulary")
    vocab = hf_encdec.vocabulary(tokenizer)
    suppress, begin = hf_encdec.suppress_ids(model_dir)
    return Whisper(model, params, tuple(vocab), suppress, begin,
                   whisper.tokens_of(vocab).multilingual)


@dataclasses.dataclass(frozen=True)
class Segment:
    """A stretch of the audio (seconds from its start) and its text."""

    start: float
    end: float
    text: str


@dataclasses.dataclass(frozen=True)
class Transcript:
    """`language_probability` is None when the language was not detected (given, or
    an English-only model)."""

    text: str
    language: str
    language_probability: Optional[float]
    segments: tuple[Segment, ...]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"segments": [dataclasses.asdict(s)
                                                        for s in self.segments]}


# -- text and output formats -------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: {printable character: the byte it stands for}."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = printable + [256 + i for i in range(len(others))]
    return {chr(c): b for b, c in zip(printable + others, chars)}


def decode_text(vocab: Sequence[str], ids: Sequence[int]) -> str:
    """The text of token ids; special tokens and timestamps (ids >= <|endoftext|>) are
    skipped. Bytes that are not valid UTF-8 (a character cut by the window edge)
    become U+FFFD."""
    eot = whisper.tokens_of(list(vocab)).eot
    table = byte_decoder()
    data = bytes(table[ch] for i in ids if i < eot for ch in vocab[i])
    return data.decode("utf-8", errors="replace")


def srt_time(seconds: float) -> str:
    """SubRip time: HH:MM:SS,mmm."""
    ms = int(round(max(seconds, 0.0) * 1000))
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d},{ms % 1000:03d}"


def srt(segments: Sequence[Segment]) -> str:
    """SubRip subtitles: numbered blocks of `start --> end` and the text."""
    return "".join(f"{i}\n{srt_time(s.start)} --> {srt_time(s.end)}\n{s.text}\n\n"
                   for i, s in enumerate(segments, 1))


def to_text(result: Transcript, timestamps: bool = False) -> str:
    """The text, or one `[start --> end] text` line per segment."""
    if not timestamps:
        return result.text
    return "\n".join(f"[{srt_time(s.start).replace(',', '.')} --> "
                     f"{srt_time(s.end).replace(',', '.')}] {s.text}" for s in result.segments)


def to_json(result: Transcript) -> str:
    """One JSON line: text, language, language_probability, segments."""
    return json.dumps(result.to_dict(), ensure_ascii=False)


# -- windows and segments ----------------------------------------------------------------


def window_samples(source, seek: int) -> np.ndarray:
    """The (<= 480,000) samples of the 30 s window from mel frame `seek` on, read from
    `source` (an `audio.WavFile`, `audio.Samples` or an (N,) array)."""
    start = seek * audio_lib.HOP
    if isinstance(source, np.ndarray):
        return source[start:start + audio_lib.CHUNK_SAMPLES]
    return source.read(start, start + audio_lib.CHUNK_SAMPLES)


def features_of(chunk_N: np.ndarray) -> np.ndarray:
    """(3000, 80) log-mel features of up to 30 s of samples (zero-padded)."""
    return np.asarray(audio_lib.log_mel_spectrogram(audio_lib.pad_or_trim(chunk_N)[None]))[0]


def window_features(source, seek: int) -> np.ndarray:
    """(3000, 80) log-mel features of the 30 s of audio from mel frame `seek` on."""
    return features_of(window_samples(source, seek))


def split_segments(tokens: Sequence[int], timestamp_begin: int, seek: int, size: int
                   ) -> tuple[list[tuple[float, float, list[int]]], int]:
    """openai-whisper's reading of one window's timestamped tokens.

    Args:
      tokens: the generated ids (text and timestamps, no EOS).
      seek: the window's first mel frame; size: its frames of audio (<= 3000).
    Returns:
      ([(start s, end s, ids)], frames to advance). Each pair of consecutive
      timestamps closes a segment; if the window ends inside a segment (its
      last timestamp is not a single closing one), the next window starts at
      the last complete segment's end, otherwise after this window.
    """
    offset = seek / FRAMES_PER_SECOND
    is_time = [t >= timestamp_begin for t in tokens]
    single_ending = is_time[-2:] == [False, True]
    cuts = [i for i in range(1, len(tokens)) if is_time[i - 1] and is_time[i]]
    seconds = lambda t: offset + (t - timestamp_begin) * whisper.TIME_PRECISION  # noqa: E731
    if not cuts:
        times = [t for t, ts in zip(tokens, is_time) if ts]
        duration = (seconds(times[-1]) - offset if times and times[-1] != timestamp_begin
                    else size / FRAMES_PER_SECOND)
        return [(offset, offset + duration, list(tokens))], size
    if single_ending:
        cuts.append(len(tokens))
    segments, last = [], 0
    for cut in cuts:
        piece = tokens[last:cut]
        segments.append((seconds(piece[0]), seconds(piece[-1]), list(piece)))
        last = cut
    if single_ending:
        return segments, size
    advance = (tokens[last - 1] - timestamp_begin) * FRAMES_PER_TOKEN
    return segments, advance if advance > 0 else size  # never stand still


# -- the pipeline --------------------------------------------------------------------------

AudioInput = Union[str, os.PathLike, np.ndarray, audio_lib.WavFile, audio_lib.Samples]


def check_options(w: Whisper, language: str, task: str) -> whisper.Tokens:
    """ValueError naming a bad language, task, or a combination the model cannot do."""
    t = whisper.tokens_of(list(w.vocab))
    if task not in whisper.TASKS:
        raise ValueError(f"task must be one of {whisper.TASKS}, got {task!r}")
    if language != "auto":
        t.language_id(language)
    if not w.multilingual and (language not in ("auto", "en") or task != "transcribe"):
        raise ValueError(f"this is an English-only Whisper model ({len(w.vocab)} tokens): it "
                         f"transcribes English only (got language={language!r}, task={task!r})")
    return t


def check_thresholds(no_speech_threshold, logprob_threshold) -> None:
    """ValueError unless each is None or a finite number (no_speech_threshold in [0, 1])."""
    for name, value in (("no_speech_threshold", no_speech_threshold),
                        ("logprob_threshold", logprob_threshold)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) or (
                not np.isfinite(value)):
            raise ValueError(f"{name} must be a finite number or None, got {value!r}")
    if no_speech_threshold is not None and not 0 <= no_speech_threshold <= 1:
        raise ValueError(f"no_speech_threshold is a probability in [0, 1], got "
                         f"{no_speech_threshold!r}")


def read_audio(item: AudioInput):
    """A source of 16 kHz mono samples read window by window: a WAV path (any rate
    and channels; the header is checked now, the samples are read as they are
    needed: `audio.open_wav`), a `WavFile`, or (N,) samples (`audio.Samples`)."""
    if isinstance(item, (audio_lib.WavFile, audio_lib.Samples)):
        return item
    if isinstance(item, (str, os.PathLike)):
        return audio_lib.open_wav(os.fspath(item))
    return audio_lib.Samples(item)


def padded_rows(n: int, batch_size: int) -> int:
    """Rows of a batch holding `n` windows: the next power of two, at most batch_size."""
    return min(batch_size, 1 << max(n - 1, 0).bit_length())


def transcribe(w: Whisper, audio: Union[AudioInput, Sequence[AudioInput]], *,
               language: str = "auto", task: str = "transcribe", timestamps: bool = False,
               batch_size: int = 8, max_text_tokens: int = 224,
               no_speech_threshold: Optional[float] = 0.6,
               logprob_threshold: Optional[float] = -1.0,
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

    Args:
      w: `load(model_dir)`.
      audio: a WAV path, an `audio.WavFile`, or (N,) float 16 kHz samples, or a
        list of these (then a list of results, in order).
      language: "auto" (detected per file on its first 30 s, from the language
        tokens: `whisper.detect_language`) or a code such as "en"; English-only
        models take "auto" or "en" and report "en" without a probability.
      task: "transcribe" or "translate" (to English; multilingual models).
      timestamps: decode segment timestamps (`<|0.00|>` tokens, Whisper's rules)
        and seek by the last complete segment; else one segment per 30 s window.
      batch_size: windows decoded together (at most).
      max_text_tokens: tokens generated per window at most (Whisper: 224).
      no_speech_threshold, logprob_threshold: the no-speech rule (0.6, -1.0 as
        openai-whisper).
      progress: called as `progress(seconds done, seconds in total)` after each
        window skipped and each batch decoded.
    Raises:
      ValueError (an unknown language code, task, or an option the model cannot
      do) and FileFormatError (a file that is not WAV audio) before any decoding.
    """
    single = isinstance(audio, (str, os.PathLike, audio_lib.WavFile, audio_lib.Samples)) or (
        isinstance(audio, np.ndarray) and audio.ndim == 1)
    items = [audio] if single else list(audio)
    t = check_options(w, language, task)
    if batch_size < 1 or max_text_tokens < 1:
        raise ValueError(f"batch_size and max_text_tokens must be >= 1, got {batch_size}, "
                         f"{max_text_tokens}")
    check_thresholds(no_speech_threshold, logprob_threshold)
    sources = [read_audio(item) for item in items]  # every file is checked first
    frames = [s.num_samples // audio_lib.HOP for s in sources]
    languages, probabilities = detect(w, t, sources, language, batch_size)
    prompts = [whisper.prompt_ids(list(w.vocab), lang if w.multilingual else None, task,
                                  timestamps) for lang in languages]
    windows = Windows(w, sources, prompts, max_text_tokens, no_speech_threshold,
                      logprob_threshold)
    total = sum(frames) / FRAMES_PER_SECOND
    report = (lambda done: progress(done / FRAMES_PER_SECOND, total)) if progress else None
    if timestamps:
        segments = seek_windows(windows, frames, t.timestamp_begin, batch_size, report)
    else:
        segments = consecutive_windows(windows, frames, batch_size, report)
    results = []
    for lang, prob, segs in zip(languages, probabilities, segments):
        ids = [i for _, _, piece in segs for i in piece]
        texts = [decode_text(w.vocab, piece).strip() for _, _, piece in segs]
        results.append(Transcript(
            decode_text(w.vocab, ids).strip(), lang, prob,
            tuple(Segment(round(a, 3), round(b, 3), text)
                  for (a, b, _), text in zip(segs, texts) if text)))  # silence: no segment
    return results[0] if single else results


def detect(w: Whisper, t: whisper.Tokens, sources: list, language: str,
           batch_size: int) -> tuple[list[str], list[Optional[float]]]:
    """Each file's language and its probability (None where not detected)."""
    if language != "auto" or not w.multilingual:
        return ["en" if language == "auto" else language] * len(sources), [None] * len(sources)
    rows = padded_rows(len(sources), batch_size)
    languages, probabilities = [], []
    for i in range(0, len(sources), rows):
        chunk = [window_features(s, 0) for s in sources[i:i + rows]]
        features = np.stack(chunk + [chunk[0]] * (rows - len(chunk)))
        for code, p in whisper.detect_language(w.model, w.params, list(w.vocab),
                                               features)[:len(chunk)]:
            languages.append(code)
            probabilities.append(p)
    return languages, probabilities


@dataclasses.dataclass
class Windows:
    """Reads, checks and decodes the 30 s windows of a run's files.

    `features(f, seek)` reads one window of file f (None if digitally silent);
    `decode([(f, features)], rows)` decodes windows as one batch of `rows` rows
    and returns each one's ids, or None where the no-speech rule drops it.
    """

    w: Whisper
    sources: list
    prompts: list
    max_text_tokens: int
    no_speech_threshold: Optional[float]
    logprob_threshold: Optional[float]

    def features(self, f: int, seek: int) -> Optional[np.ndarray]:
        chunk = window_samples(self.sources[f], seek)
        return None if audio_lib.is_silent(chunk) else features_of(chunk)

    def decode(self, batch: list[tuple[int, np.ndarray]], rows: int
               ) -> list[Optional[list[int]]]:
        padded = batch + [batch[-1]] * (rows - len(batch))
        out = whisper.generate(self.w.model, self.w.params, list(self.w.vocab),
                               np.stack([x for _, x in padded]),
                               [self.prompts[f] for f, _ in padded],
                               suppress_ids=self.w.suppress_ids,
                               suppress_ids_begin=self.w.suppress_ids_begin,
                               max_text_tokens=self.max_text_tokens)
        return [None if self.no_speech(g) else g.ids for g in out[:len(batch)]]

    def no_speech(self, g: whisper.Generated) -> bool:
        """openai-whisper's rule: likely no speech, unless the text is confident."""
        if self.no_speech_threshold is None or g.no_speech_prob is None:
            return False
        return g.no_speech_prob > self.no_speech_threshold and not (
            self.logprob_threshold is not None and g.avg_logprob > self.logprob_threshold)


def consecutive_windows(windows: Windows, frames: list[int], batch_size: int, report
                        ) -> list[list[tuple[float, float, list[int]]]]:
    """Every file cut in consecutive 30 s windows (at least one), read one at a time;
    silent windows are skipped, the others decoded in batches of `batch_size`."""
    starts = [(f, seek) for f, n in enumerate(frames)
              for seek in range(0, max(n, 1), WINDOW_FRAMES)]
    rows = padded_rows(len(starts), batch_size)
    found = {}  # (f, seek) -> ids
    done, pending = 0, []

    def size(f, seek):
        return min(seek + WINDOW_FRAMES, frames[f]) - seek

    def flush():
        nonlocal done
        for (f, seek), ids in zip([k for k, _ in pending],
                                  windows.decode([(k[0], x) for k, x in pending], rows)):
            if ids is not None:
                found[f, seek] = ids
            done += size(f, seek)
        pending.clear()
        if report:
            report(done)

    for f, seek in starts:
        x = windows.features(f, seek)
        if x is None:  # digitally silent: no text
            done += size(f, seek)
            if report:
                report(done)
            continue
        pending.append(((f, seek), x))
        if len(pending) == rows:
            flush()
    if pending:
        flush()
    segments = [[] for _ in frames]
    for (f, seek), ids in sorted(found.items()):
        end = min(seek + WINDOW_FRAMES, frames[f])
        segments[f].append((seek / FRAMES_PER_SECOND, end / FRAMES_PER_SECOND, ids))
    return segments


def seek_windows(windows: Windows, frames: list[int], timestamp_begin: int, batch_size: int,
                 report) -> list[list[tuple[float, float, list[int]]]]:
    """Timestamped windows: each file's next window starts where `split_segments` says;
    the current windows of up to `batch_size` files are decoded together. A silent
    window, or one the no-speech rule drops, is skipped whole."""
    seek = [0] * len(frames)
    segments = [[] for _ in frames]
    started = [False] * len(frames)  # an empty file still gets one window
    rows = padded_rows(len(frames), batch_size)

    def size(f):
        return max(min(WINDOW_FRAMES, frames[f] - seek[f]), 0)

    def progressed():
        if report:
            report(sum(min(s, n) for s, n in zip(seek, frames)))

    while True:
        batch = []
        for f in range(len(frames)):
            while len(batch) < rows and (seek[f] < frames[f] or not started[f]):
                started[f] = True
                x = windows.features(f, seek[f])
                if x is not None:
                    batch.append((f, x))
                    break
                seek[f] += max(size(f), 1)  # digitally silent: skipped
                progressed()
        if not batch:
            return segments
        for (f, _), ids in zip(batch, windows.decode(batch, rows)):
            s, n = seek[f], size(f)
            if ids is None:  # no speech
                seek[f] = s + max(n, 1)
                continue
            pieces, advance = split_segments(ids, timestamp_begin, s, n)
            segments[f].extend(pieces)
            seek[f] = s + max(advance, 1)
        progressed()

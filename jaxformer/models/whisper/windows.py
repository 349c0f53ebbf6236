"""The 30 s windows of long audio: reading them, decoding them in batches, and
cutting timestamped windows into segments (openai-whisper's `transcribe` loop).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import numpy as np

from jaxformer.models.whisper import audio as audio_lib
from jaxformer.models.whisper import features as features_lib
from jaxformer.models.whisper.checkpoint import Whisper
from jaxformer.models.whisper.config import N_FRAMES
from jaxformer.models.whisper import decoding
from jaxformer.models.whisper import speech as speech_lib
from jaxformer.models.whisper.decoding import Generated
from jaxformer.models.whisper.hallucination import skip_hallucinations
from jaxformer.models.whisper.fallback import (Safeguards, final_choice, is_no_speech,
                                                needs_fallback)
from jaxformer.models.whisper.prompt import Context
from jaxformer.models.whisper.words import find_alignment, window_words
from jaxformer.models.whisper.tokens import TIME_PRECISION, decode_text
from jaxformer.nn.checks import check_finite_params

HOP = features_lib.HOP
FRAMES_PER_SECOND = audio_lib.SAMPLE_RATE // HOP  # 100
FRAMES_PER_TOKEN = 2  # the encoder's second convolution has stride 2
WINDOW_FRAMES = N_FRAMES  # 3000 mel frames = 30 s


def window_samples(source, seek: int) -> np.ndarray:
    """The (<= 480,000) samples of the 30 s window from mel frame `seek` on, read from
    `source` (an `audio.WavFile`, `audio.Samples` or an (N,) array)."""
    start = seek * features_lib.HOP
    if isinstance(source, np.ndarray):
        return source[start:start + features_lib.CHUNK_SAMPLES]
    return source.read(start, start + features_lib.CHUNK_SAMPLES)


def features_of(chunk_N: np.ndarray, n_mels: int = features_lib.N_MELS) -> np.ndarray:
    """(3000, n_mels) log-mel features of up to 30 s of samples.

    A chunk shorter than 30 s (the end of a file) is padded as faster-whisper pads
    it: the frames of the audio (and of one hop of zeros after it) are computed,
    the frames after them are 0.0 (openai-whisper pads the audio with zeros
    instead, which gives those frames the floor value of the window: the text of
    a short clip can differ by a word)."""
    out = np.array(features_lib.log_mel_spectrogram(
        features_lib.pad_or_trim(chunk_N)[None], n_mels))[0]
    if len(chunk_N) < features_lib.CHUNK_SAMPLES:
        out[len(chunk_N) // features_lib.HOP + 1:] = 0.0
    return out


def window_features(source, seek: int, n_mels: int = features_lib.N_MELS) -> np.ndarray:
    """(3000, n_mels) log-mel features of the 30 s of audio from mel frame `seek` on."""
    return features_of(window_samples(source, seek), n_mels)


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
    seconds = lambda t: offset + (t - timestamp_begin) * TIME_PRECISION  # noqa: E731
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



def padded_rows(n: int, batch_size: int) -> int:
    """Rows of a batch holding `n` windows: the next power of two, at most batch_size."""
    return min(batch_size, 1 << max(n - 1, 0).bit_length())



@dataclasses.dataclass
class Windows:
    """Reads, checks and decodes the 30 s windows of a run's files.

    `features(f, seek)` reads one window of file f (None if digitally silent);
    `decode([(f, features)], rows)` decodes windows as one batch of `rows` rows,
    with the temperature fallback (`fallback`; at temperature 0, beam search when
    `beam_size` > 1, with `patience` and `length_penalty`: `decoding.generate`),
    and returns each one's ids, or None where the no-speech rule drops it. `log` records, per decoded window, (file,
    temperatures tried, dropped). A batch is encoded once (`encode`:
    `decoding.encode_windows`), whatever the temperatures tried; `generate` is
    `decoding.generate` (a test may script both). With a `context` (`prompt.Context`), each window's prompt is its
    file's prompt after the file's text so far (`seek_windows` feeds it).
    """

    w: Whisper
    sources: list
    prompts: list
    max_text_tokens: int
    safeguards: Safeguards = dataclasses.field(default_factory=Safeguards)
    generate: Optional[Callable[..., list[Generated]]] = None  # None: decoding.generate
    encode: Optional[Callable] = None  # None: decoding.encode_windows
    beam_size: int = 1
    patience: float = 1.0
    length_penalty: float = 1.0
    context: Optional[Context] = None
    word_heads: tuple = ()  # (layer, head) pairs: word timestamps (`words`), or ()
    hallucination_silence_threshold: Optional[float] = None  # `hallucination`, with words

    def prompt(self, f: int) -> list[int]:
        return self.context.prompt(f, self.prompts[f]) if self.context else self.prompts[f]

    def __post_init__(self):
        self.n_mels = self.w.n_mels
        self.generate = self.generate or decoding.generate
        self.encode = self.encode or decoding.encode_windows
        check_finite_params(self.w.params)  # NaN/inf refused once, not once per window
        self.log: list[tuple[int, tuple[float, ...], bool]] = []

    def rank(self, g: Generated) -> float:
        """The score the best of several samples is chosen by (CTranslate2's, which
        faster-whisper keeps): the summed log-probability / length ** length_penalty."""
        n = len(g.ids)
        total = g.avg_logprob * (n + 1)
        if n == 0:
            return total if self.length_penalty == 0 else float("-inf")
        return total / n ** self.length_penalty

    def features(self, f: int, seek: int, stop: Optional[int] = None
                 ) -> Optional[np.ndarray]:
        """The window's features; with `stop` (a clip's end), the frames from mel frame
        `stop` on are 0.0 (faster-whisper's slice of the file's features, padded)."""
        chunk = window_samples(self.sources[f], seek)
        inside = chunk if stop is None else chunk[:max(stop - seek, 0) * features_lib.HOP]
        if audio_lib.is_silent(inside):
            return None
        out = features_of(chunk, self.n_mels)
        if stop is not None:
            out[max(stop - seek, 0):] = 0.0
        return out

    def decode(self, batch: list[tuple[int, np.ndarray]], rows: int
               ) -> list[Optional[list[int]]]:
        s, vocab = self.safeguards, list(self.w.vocab)
        chosen: list[Optional[Generated]] = [None] * len(batch)
        tried: list[list[tuple[Generated, str]]] = [[] for _ in batch]
        todo = list(range(len(batch)))
        prompts = [self.prompt(f) for f, _ in batch]
        encoded = self.encode(self.w.model, self.w.params, np.stack(
            [x for _, x in batch] + [batch[-1][1]] * (rows - len(batch))))
        for k, temperature in enumerate(s.temperatures):
            copies = 1 if temperature == 0 else s.best_of  # sampled: best of `copies`
            padded = todo + [todo[-1]] * (rows - len(todo))
            out = self.generate(self.w.model, self.w.params, vocab,
                                encoded if padded == list(range(rows)) else encoded[padded],
                                [prompts[i] for i in padded], copies=copies,
                                suppress_ids=self.w.suppress_ids,
                                suppress_ids_begin=self.w.suppress_ids_begin,
                                max_text_tokens=self.max_text_tokens,
                                temperature=temperature, seed=k, beam_size=self.beam_size,
                                patience=self.patience, length_penalty=self.length_penalty,
                                check_params=False)
            again = []
            for n, i in enumerate(todo):
                g = max(out[n * copies:(n + 1) * copies], key=self.rank)
                text = decode_text(vocab, g.ids).strip()
                tried[i].append((g, text))
                if needs_fallback(text, g.avg_logprob, g.no_speech_prob, s):
                    again.append(i)
                else:
                    chosen[i] = g
            todo = again
            if not todo:
                break
        for i in todo:  # every temperature failed
            chosen[i] = tried[i][final_choice([(t, g.avg_logprob) for g, t in tried[i]], s)][0]
        dropped = [is_no_speech(g.avg_logprob, g.no_speech_prob, s) for g in chosen]
        self.log.extend((f, s.temperatures[:len(t)], d)
                        for (f, _), t, d in zip(batch, tried, dropped))
        return [None if d else g.ids for g, d in zip(chosen, dropped)]


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
                 report, clips: Optional[Sequence[tuple[int, Optional[int]]]] = None
                 ) -> list[list[tuple[float, float, list[int]]]]:
    """Sequential windows: each file's next window starts where `split_segments` says
    (after the window when it has no timestamps); the current windows of up to
    `batch_size` files are decoded together. A silent window, or one the no-speech
    rule drops, is skipped whole. With `windows.context`, each decoded window's
    segments (those with text) join its file's prompt (`prompt.Context.add`).
    `clips`: (first frame, end frame or None for the file's end) of the stretches of
    every file to decode, in order (openai-whisper's `clip_timestamps`): windows
    start inside them and their audio stops at their end."""
    clips = list(clips) if clips else [(0, None)]
    clip = [0] * len(frames)  # per file, the clip being decoded
    seek = [0] * len(frames)
    last_speech = [0.0] * len(frames)  # per file, for word timestamps
    segments = [[] for _ in frames]
    started = [False] * len(frames)  # an empty file still gets one window
    rows = padded_rows(len(frames), batch_size)

    def clip_end(f):
        end = clips[min(clip[f], len(clips) - 1)][1]
        return frames[f] if end is None else min(end, frames[f])

    def active(f):
        """Moves file f's seek into its current clip (or the next); False when done."""
        while clip[f] < len(clips):
            seek[f] = max(seek[f], clips[clip[f]][0])
            if seek[f] < clip_end(f):
                return True
            clip[f] += 1
        return False

    def size(f):
        return max(min(WINDOW_FRAMES, clip_end(f) - seek[f]), 0)

    def progressed():
        if report:
            report(sum(min(s, n) for s, n in zip(seek, frames)))

    while True:
        batch = []
        for f in range(len(frames)):
            while len(batch) < rows and (active(f) or not started[f]):
                started[f] = True
                x = windows.features(f, seek[f], clip_end(f) if clip_end(f) < frames[f]
                                     else None)
                if x is not None:
                    batch.append((f, x))
                    break
                seek[f] += max(size(f), 1)  # digitally silent: skipped
                progressed()
        if not batch:
            return segments
        x_of = [x for _, x in batch]
        for k, ((f, _), ids) in enumerate(zip(batch, windows.decode(batch, rows))):
            s, n = seek[f], size(f)
            if ids is None:  # no speech
                seek[f] = s + max(n, 1)
                continue
            pieces, advance = split_segments(ids, timestamp_begin, s, n)
            redo = False
            if windows.word_heads:
                pieces, advance, redo = add_words(windows, f, x_of[k], pieces, ids, s, n,
                                                  advance, last_speech, timestamp_begin)
            segments[f].extend(pieces)
            if windows.context and not redo:  # the window's text joins the file's prompt
                temperature = windows.log[-len(batch):][k][1][-1]
                windows.context.add(f, [p for a, b, p, *_ in pieces if a != b and decode_text(
                    windows.w.vocab, p).strip()], temperature)
            seek[f] = s + max(advance, 1)
        progressed()


def add_words(windows: Windows, f: int, features_TM, pieces, ids, seek: int, size: int,
              advance: int, last_speech: list, timestamp_begin: int):
    """A window's segments with their words (`words.find_alignment`,
    `words.window_words`) as 4-tuples (start, end, ids, words), and the frames to
    advance: when the window does not end on a single timestamp, the next one
    starts at the last word's end (faster-whisper); with
    `windows.hallucination_silence_threshold`, `hallucination.skip_hallucinations`
    then drops likely hallucinations (third value: the whole window is dropped and
    decoded again from the returned advance). The file's prompt (timestamps
    on) is the <|startoftranscript|> sequence the alignment forward starts with."""
    eot = windows.w.model.config.eos_id
    before = last_speech[f]
    # faster-whisper counts one frame more at the end of a file (its features of the
    # samples and one hop of padding): the alignment reads that frame too.
    last = seek + size >= windows.sources[f].num_samples // HOP
    alignment = find_alignment(windows.w, windows.word_heads, features_TM, windows.prompts[f],
                               [i for i in ids if i < eot], min(size + last, WINDOW_FRAMES))
    offset = seek / FRAMES_PER_SECOND
    bounds, words, last_speech[f] = window_words(alignment, pieces, offset, eot, last_speech[f])
    out = [(a, b, p, tuple(w)) for (a, b, p), w in zip(bounds, words)]
    ends = [w.end for *_, ws in reversed(out) for w in reversed(ws)]
    end = ends[0] if ends else (out[-1][1] if out else None)
    if end is not None:
        last_speech[f] = end
    single_ending = [i >= timestamp_begin for i in ids[-2:]] == [False, True]
    if not single_ending and end is not None and end > offset:
        advance = round(end * FRAMES_PER_SECOND) - seek
    threshold = windows.hallucination_silence_threshold
    if threshold is None:
        return out, advance, False
    out, new_seek, redo = skip_hallucinations(
        out, threshold, seek, size, before, windows.sources[f].num_samples // HOP)
    ends = [w.end for *_, ws in reversed(out) for w in reversed(ws)]
    end = ends[0] if ends else (out[-1][1] if out else None)
    last_speech[f] = before if redo or end is None else end
    return out, advance if new_seek is None else new_seek - seek, redo


def packed_windows(windows: Windows, chunks: list[list[list[tuple[int, int]]]],
                   timestamp_begin: Optional[int], batch_size: int, report
                   ) -> list[list[tuple]]:
    """Each file's chunks of speech (`speech.pack`: lists of (first sample, end
    sample) regions, each chunk at most 30 s of audio) decoded once each, all of
    them together in batches of `batch_size`, as faster-whisper's batched pipeline
    decodes them; times are mapped back to the file (`speech.original_time`).

    Without timestamps (`timestamp_begin` None) a chunk is one segment, from its
    first region's start to its last region's end. With timestamps a chunk's
    complete segments (`split_segments`; a segment the chunk's end cuts is left
    out, as faster-whisper's batched pipeline does) are mapped back: a segment's
    start by the region it starts in, its end by the region it ends in. With
    `windows.word_heads` each word is mapped by the region of its middle, and its
    segment spans its words (faster-whisper's `restore_speech_timestamps`)."""
    jobs = []  # (file, chunk, the chunk's start in the file's speech alone in seconds)
    for f, file_chunks in enumerate(chunks):
        total = 0
        for chunk in file_chunks:
            jobs.append((f, chunk, total / audio_lib.SAMPLE_RATE))
            total += sum(b - a for a, b in chunk)
    # Rows: the chunks themselves, not padded to a power of two as the 30 s windows
    # are: a padded row is decoded at every step (the 10 min benchmark file's 5
    # chunks on 8 rows took 1.5x the time of 5 rows, beam 5); a batch size is one
    # more compiled program, once per run.
    rows = max(min(len(jobs), batch_size), 1)
    segments = [[] for _ in chunks]
    last_speech = [0.0] * len(chunks)
    done, pending = 0, []

    def flush():
        nonlocal done
        decoded = windows.decode([(job[0], x) for job, x in pending], rows)
        for ((f, chunk, offset, n), x), ids in zip(pending, decoded):
            if ids is not None:
                segments[f].extend(chunk_segments(windows, f, chunk, offset, x, ids, n,
                                                  timestamp_begin, last_speech))
            done += (chunk[-1][1] - chunk[0][0]) // HOP
        pending.clear()
        if report:
            report(done)

    for f, chunk, offset in jobs:
        samples = speech_lib.chunk_samples(windows.sources[f], chunk)
        if audio_lib.is_silent(samples):
            done += (chunk[-1][1] - chunk[0][0]) // HOP
            continue
        pending.append(((f, chunk, offset, len(samples)), features_of(samples, windows.n_mels)))
        if len(pending) == rows:
            flush()
    if pending:
        flush()
    return segments


def chunk_segments(windows: Windows, f: int, chunk, offset: float, features_TM, ids,
                   num_samples: int, timestamp_begin: Optional[int], last_speech: list
                   ) -> list[tuple]:
    """One decoded chunk's segments in the file's seconds (`packed_windows`). Words
    are timed first in the file's speech alone (the chunk starting `offset` seconds
    into it, as faster-whisper times them, so that `last_speech` carries over from
    chunk to chunk), then mapped back."""
    first, last = chunk[0][0] / audio_lib.SAMPLE_RATE, chunk[-1][1] / audio_lib.SAMPLE_RATE
    if timestamp_begin is None:
        return [(first, last, list(ids))]
    size = min(num_samples // HOP + 1, WINDOW_FRAMES)  # one frame more at the end, as add_words
    pieces, _ = split_segments(ids, timestamp_begin, 0, size)
    if not windows.word_heads:
        return [(speech_lib.original_time(chunk, a), speech_lib.original_time(chunk, b,
                                                                              is_end=True), p)
                for a, b, p in pieces]
    eot = windows.w.model.config.eos_id
    alignment = find_alignment(windows.w, windows.word_heads, features_TM, windows.prompts[f],
                               [i for i in ids if i < eot], size)
    pieces = [(a + offset, b + offset, p) for a, b, p in pieces]
    bounds, words, last_speech[f] = window_words(alignment, pieces, offset, eot,
                                                 last_speech[f])
    out = []
    for (a, b, p), ws in zip(bounds, words):
        a, b, moved = a - offset, b - offset, []
        for word in ws:
            start, end = word.start - offset, word.end - offset
            k = speech_lib.region_index(chunk, (start + end) / 2)
            moved.append(dataclasses.replace(
                word, start=round(speech_lib.original_time(chunk, start, k), 2),
                end=round(speech_lib.original_time(chunk, end, k), 2)))
        if moved:
            a, b = moved[0].start, moved[-1].end
        else:
            a, b = (speech_lib.original_time(chunk, a),
                    speech_lib.original_time(chunk, b, is_end=True))
        out.append((a, b, p, tuple(moved)))
    return out

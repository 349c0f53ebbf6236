"""`jaxformer transcribe`: Whisper over audio and video files (`jaxformer.models.whisper`).

    jaxformer transcribe --model DIR talk.wav            # the text
    jaxformer transcribe --model DIR a.wav b.wav --json  # one JSON line per file
    jaxformer transcribe --model DIR talk.wav --timestamps --format srt   # or vtt, tsv
    jaxformer transcribe --model DIR talk.wav --word-timestamps --format vtt --max-line-width 42
    jaxformer transcribe --model DIR talk.wav --initial-prompt "Glossary: JAX, Flax."
    jaxformer transcribe --model DIR talk.wav --word-timestamps --json   # words in JSON
    jaxformer transcribe --model DIR talk.wav --vad-filter --timestamps  # speech packed, batched

DIR is a CTranslate2 Whisper folder (`model.bin`, `vocabulary.txt`,
`config.json`) or a Hugging Face Whisper directory (`config.json`,
safetensors, `tokenizer.json`). Any WAV sample rate and channel count, and with
PyAV (`pip install 'jaxformer[media]'`) any audio or video container (MP3, FLAC,
M4A, OGG, MP4, MKV, ...), decoded as a stream; audio longer than 30 s
is decoded in windows; every file is read and every option checked before the
model loads. Files are read window by window (memory does not grow with their
length); silence gives an empty transcript (`whisper.transcribe`).

Progress goes to stderr: a bar when stderr is a terminal, otherwise (or with
`--no-progress`) one status line every 10 s once a run has taken that long.
"""

from __future__ import annotations

import json
import os
import sys
import time

import argparse
import math

from jaxformer.cli.args import finite_float, positive_float, positive_int
from jaxformer.cli.usage import UsageError, require_positive

EXTENSIONS = {"text": "txt", "json": "json", "srt": "srt", "vtt": "vtt", "tsv": "tsv"}
FORMATS = (*EXTENSIONS, "all")
SUBTITLES = ("srt", "vtt", "all")  # the formats the word layout flags shape
TIMED = ("srt", "vtt", "tsv", "all")  # the formats that need --timestamps
STATUS_EVERY_S = 10.0  # seconds between two status lines (no terminal, or --no-progress)


def add_parser(commands, add_common_flags) -> None:
    """Register the subcommand on `commands` (argparse subparsers)."""
    parser = commands.add_parser(
        "transcribe", help="speech to text with a Whisper model",
        description="Transcribe (or translate to English) audio files with a Whisper "
                    "model (CTranslate2 or Hugging Face directory): WAV of any sample rate "
                    "and channel count, and with PyAV (the media extra) any audio or video "
                    "file; any length.")
    parser.add_argument("audio", nargs="+", metavar="AUDIO",
                        help="WAV files, or any audio or video file with PyAV installed")
    parser.add_argument("--model", required=True, metavar="DIR",
                        help="a CTranslate2 Whisper folder (model.bin, vocabulary.txt, "
                             "config.json) or a Hugging Face Whisper directory")
    parser.add_argument("--language", default="auto",
                        help='"auto" (detected per file) or a code such as "en" (default auto)')
    parser.add_argument("--task", choices=("transcribe", "translate"), default="transcribe")
    parser.add_argument("--timestamps", action="store_true",
                        help="segment timestamps (Whisper's timestamp tokens)")
    parser.add_argument("--word-timestamps", action="store_true",
                        help="each segment's words with start, end and probability (JSON; "
                             "implies --timestamps): cross-attention alignment as "
                             "faster-whisper")
    parser.add_argument("--format", choices=FORMATS, default="text",
                        help="text, json (one line per file), srt, vtt (subtitles), tsv "
                             "(start and end in ms, text) or all (each of them, with "
                             "--output-dir); srt, vtt, tsv and all need --timestamps "
                             "(default text)")
    parser.add_argument("--output-dir", metavar="DIR", default=None,
                        help="write each file's result to DIR/NAME.txt (.json, .srt, .vtt, "
                             ".tsv) instead of stdout; existing files are never "
                             "overwritten (refused before decoding)")
    parser.add_argument("--json", action="store_const", const="json", dest="format",
                        help="the same as --format json")
    layout = parser.add_argument_group(
        "subtitle layout", "srt and vtt cues cut by word timing, as openai-whisper's writers "
        "(need --word-timestamps)")
    layout.add_argument("--highlight-words", action="store_true",
                        help="a cue per word, the word underlined (<u>word</u>)")
    layout.add_argument("--max-line-width", type=positive_int, default=None, metavar="N",
                        help="characters per line before a line break")
    layout.add_argument("--max-line-count", type=positive_int, default=None, metavar="N",
                        help="lines per cue (needs --max-line-width; cues then ignore "
                             "segment bounds)")
    layout.add_argument("--max-words-per-line", type=positive_int, default=None, metavar="N",
                        help="words per cue, each segment cut in turn")
    parser.add_argument("--clip-timestamps", metavar="START,END,...", default=None,
                        help="decode only these stretches of each file, in seconds "
                             "(the last end may be left out: the file's end)")
    parser.add_argument("--batch", type=positive_int, default=8,
                        help="30 s windows decoded together")
    parser.add_argument("--cpu-tuning", action="store_true",
                        help="the model's opt-in CPU tricks (TransformerConfig.cpu_tuning: "
                             "the encoder's attention formed a block of queries at a time)")
    parser.add_argument("--vad-filter", action=argparse.BooleanOptionalAction, default=None,
                        help="speech packing, as faster-whisper's batched pipeline: find "
                             "each file's speech (an energy detector with silero's rules, "
                             "not silero's network), join it into chunks of at most 30 s "
                             "and decode the chunks together, once each (no conditioning "
                             "on previous text); times are mapped back to the file. Default: "
                             "on for a file over 30 s without --timestamps and with "
                             "--no-condition-on-previous-text, off otherwise")
    safeguards = parser.add_argument_group(
        "long-form safeguards", "openai-whisper's temperature fallback and no-speech rule "
        "(defaults as faster-whisper; 'none' turns a threshold off)")
    safeguards.add_argument("--temperature", type=temperatures, default=None,
                            metavar="T[,T...]",
                            help="temperatures tried in turn (default 0,0.2,0.4,0.6,0.8,1; "
                                 "0 alone: greedy once)")
    safeguards.add_argument("--best-of", type=positive_int, default=5,
                            help="samples per window at a temperature above 0 (default 5)")
    safeguards.add_argument("--compression-ratio-threshold", type=optional_number,
                            default=2.4, metavar="X",
                            help="fall back when the text's gzip ratio is above (default 2.4)")
    safeguards.add_argument("--logprob-threshold", type=optional_number, default=-1.0,
                            metavar="X", help="fall back when the average log-probability is "
                                              "below (default -1.0)")
    safeguards.add_argument("--no-speech-threshold", type=optional_number, default=0.6,
                            metavar="P", help="drop a window whose no-speech probability is "
                                              "above, unless confident (default 0.6)")
    safeguards.add_argument("--hallucination-silence-threshold", type=optional_number,
                            default=None, metavar="S",
                            help="with --word-timestamps: skip a likely hallucination "
                                 "(improbable, very short or long words) with over S "
                                 "seconds of silence around it, and the silence before it "
                                 "(default none)")
    beam = parser.add_argument_group(
        "beam search", "at temperature 0, as faster-whisper (CTranslate2) runs it")
    beam.add_argument("--beam-size", type=positive_int, default=5,
                      help="beams per window (default 5; 1: greedy)")
    beam.add_argument("--patience", type=positive_float, default=1.0,
                      help="finished hypotheses collected: round(beam size * patience) "
                           "(default 1.0)")
    beam.add_argument("--length-penalty", type=finite_float, default=1.0,
                      help="the kept hypothesis maximises log-probability / length ** this "
                           "(default 1.0; 0: no normalisation)")
    context = parser.add_argument_group(
        "prompt", "text the decoder reads before each window (as faster-whisper)")
    context.add_argument("--initial-prompt", metavar="TEXT", default=None,
                         help="text before the first window: names, spellings, style "
                              "(needs the model folder's tokenizer.json)")
    context.add_argument("--condition-on-previous-text", action=argparse.BooleanOptionalAction,
                         default=True,
                         help="each window reads the text so far (reset after a window "
                              "decoded above temperature 0.5); off lets a file's windows "
                              "be decoded together (default on)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar on a terminal; as when stderr is not a "
                             f"terminal, a long run prints one status line every "
                             f"{STATUS_EVERY_S:g} s on stderr instead")
    add_common_flags(parser)
    parser.set_defaults(func=run)


def temperatures(text: str) -> tuple[float, ...]:
    """argparse type: comma-separated finite numbers."""
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be numbers separated by commas, got "
                                         f"{text!r}") from None
    if not all(math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"must be finite numbers, got {text!r}")
    return values


def optional_number(text: str):
    """argparse type: a finite number, or 'none'."""
    if text.lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number or 'none', got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number or 'none', got {text!r}")
    return value


def safeguards_of(args):
    """The `Safeguards` of the flags, or UsageError naming the flag out of range."""
    from jaxformer.models import whisper  # noqa: PLC0415

    names = {"temperatures": "--temperature", "best_of": "--best-of",
             "compression_ratio_threshold": "--compression-ratio-threshold",
             "logprob_threshold": "--logprob-threshold",
             "no_speech_threshold": "--no-speech-threshold"}
    try:
        return whisper.Safeguards(
            args.temperature if args.temperature is not None else whisper.TEMPERATURES,
            args.compression_ratio_threshold, args.logprob_threshold,
            args.no_speech_threshold, args.best_of)
    except ValueError as error:
        flag = next((f for n, f in names.items() if str(error).startswith(n)), "")
        raise UsageError(f"{flag}: {error}" if flag else str(error)) from error


def beam_of(args) -> None:
    """UsageError naming the beam flag out of range."""
    from jaxformer.models import whisper  # noqa: PLC0415

    try:
        whisper.check_beam(args.beam_size, args.patience, args.length_penalty)
    except ValueError as error:
        flag = str(error).split(" ")[0].replace("_", "-")
        raise UsageError(f"--{flag}: {error}") from error


def layout_of(args) -> dict:
    """The subtitle layout options set (`whisper.cues`), or UsageError naming a flag
    that cannot act: without --word-timestamps, outside srt/vtt, or --max-line-count
    without --max-line-width."""
    flags = {"highlight_words": args.highlight_words, "max_line_width": args.max_line_width,
             "max_line_count": args.max_line_count,
             "max_words_per_line": args.max_words_per_line}
    layout = {name: value for name, value in flags.items() if value not in (None, False)}
    for name in layout:
        flag = "--" + name.replace("_", "-")
        if not args.word_timestamps:
            raise UsageError(f"{flag} needs --word-timestamps (cues are cut by word timing)")
        if args.format not in SUBTITLES:
            raise UsageError(f"{flag} shapes subtitles: it needs --format srt, vtt or all")
    if "max_line_count" in layout and "max_line_width" not in layout:
        raise UsageError("--max-line-count needs --max-line-width (lines are cut by width)")
    return layout


def run(args) -> int:
    from jaxformer.models import whisper  # noqa: PLC0415

    from jaxformer.models.whisper import check_language_code  # noqa: PLC0415

    require_positive("--batch", args.batch)
    safeguards = safeguards_of(args)
    beam_of(args)
    try:  # before the model is read
        check_language_code(args.language)
    except ValueError as error:
        raise UsageError(f"--language: {error}") from error
    if args.initial_prompt is not None and not args.initial_prompt.strip():
        raise UsageError("--initial-prompt: empty text (leave the flag out for no prompt)")
    if args.format in TIMED and not (args.timestamps or args.word_timestamps):
        raise UsageError(f"--format {args.format} needs --timestamps")
    layout = layout_of(args)
    threshold = args.hallucination_silence_threshold
    if threshold is not None and not args.word_timestamps:
        raise UsageError("--hallucination-silence-threshold needs --word-timestamps (the "
                         "rule reads the words' timing and probability)")
    if args.clip_timestamps is not None:
        try:
            whisper.parse_clips(args.clip_timestamps)
        except ValueError as error:
            raise UsageError(f"--clip-timestamps: {error}") from error
    if args.vad_filter and args.clip_timestamps is not None:
        raise UsageError("--vad-filter finds the stretches to decode itself: give "
                         "--clip-timestamps or --vad-filter, not both")
    if args.vad_filter and threshold is not None:
        raise UsageError("--hallucination-silence-threshold re-seeks windows, and --vad-filter "
                         "decodes each chunk once: use one or the other")
    if threshold is not None and threshold < 0:
        raise UsageError(f"--hallucination-silence-threshold: seconds >= 0, got {threshold:g}")
    targets = output_paths(args)
    if not os.path.isdir(args.model):
        raise UsageError(f"--model {args.model}: not a directory (a CTranslate2 Whisper "
                              "folder with model.bin, vocabulary.txt and config.json, or a "
                              "Hugging Face Whisper directory)")
    try:
        samples = [whisper.read_audio(path) for path in args.audio]  # all checked first
        w = whisper.load(args.model, cpu_tuning=args.cpu_tuning)
        whisper.check_options(w, args.language, args.task)
        results = whisper.transcribe(w, samples, language=args.language, task=args.task,
                                        timestamps=args.timestamps, batch_size=args.batch,
                                        temperature=safeguards.temperatures,
                                        best_of=safeguards.best_of,
                                        compression_ratio_threshold=(
                                            safeguards.compression_ratio_threshold),
                                        logprob_threshold=safeguards.logprob_threshold,
                                        no_speech_threshold=safeguards.no_speech_threshold,
                                        beam_size=args.beam_size, patience=args.patience,
                                        length_penalty=args.length_penalty,
                                        initial_prompt=args.initial_prompt,
                                        word_timestamps=args.word_timestamps,
                                        hallucination_silence_threshold=threshold,
                                        clip_timestamps=args.clip_timestamps,
                                        vad_filter=args.vad_filter,
                                        condition_on_previous_text=(
                                            args.condition_on_previous_text),
                                        progress=_progress_bar(args))
    except ValueError as error:  # FileFormatError included
        raise UsageError(str(error)) from error
    for path, result in zip(args.audio, results):
        for fmt in (EXTENSIONS if args.format == "all" else [args.format]):
            text = rendered(fmt, path, result, args, layout)
            if targets is None:
                print(text, end="", flush=True)
                continue
            with open(targets[path, fmt], "x", encoding="utf-8") as f:  # never overwrites
                f.write(text)
    return 0


def rendered(fmt: str, path: str, result, args, layout: dict) -> str:
    """One file's result in `fmt`, ending with a newline."""
    from jaxformer.models import whisper  # noqa: PLC0415

    if fmt == "json":
        return json.dumps({"file": path, **result.to_dict()}, ensure_ascii=False) + "\n"
    if fmt in ("srt", "vtt"):
        return getattr(whisper, fmt)(result.segments, **layout)
    if fmt == "tsv":
        return whisper.tsv(result.segments)
    prefix = f"{path}: " if len(args.audio) > 1 and args.output_dir is None else ""
    return prefix + whisper.to_text(result, args.timestamps or args.word_timestamps) + "\n"


def output_paths(args):
    """{(audio path, format): file to write} under --output-dir (None: stdout), or
    UsageError when a file is there already, two inputs share a name, or --format
    all has no --output-dir."""
    if args.output_dir is None:
        if args.format == "all":
            raise UsageError("--format all writes one file per format: it needs --output-dir")
        return None
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        raise UsageError(f"--output-dir {args.output_dir}: not a directory")
    formats = list(EXTENSIONS) if args.format == "all" else [args.format]
    targets, owners = {}, {}
    for path in args.audio:
        stem = os.path.splitext(os.path.basename(path))[0]
        for fmt in formats:
            target = os.path.join(args.output_dir, f"{stem}.{EXTENSIONS[fmt]}")
            if target in owners:
                raise UsageError(f"--output-dir: {owners[target]} and {path} would both "
                                 f"write {target}")
            if os.path.exists(target):
                raise UsageError(f"--output-dir: {target} exists (never overwritten; move "
                                 "it or choose another directory)")
            targets[path, fmt], owners[target] = target, path
    os.makedirs(args.output_dir, exist_ok=True)
    return targets


def _progress_bar(args):
    """`progress(seconds done, seconds in total)`: a tqdm bar when stderr is a terminal
    (and not --no-progress), else status lines at most every STATUS_EVERY_S."""
    isatty = getattr(sys.stderr, "isatty", None)
    if args.no_progress or not (isatty and isatty()):
        return StatusLines()
    from tqdm.auto import tqdm  # noqa: PLC0415

    bar = None

    def progress(done: float, total: float) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=round(total, 1), unit="s", desc="transcribing", file=sys.stderr,
                       dynamic_ncols=True, leave=False)
        bar.update(round(done, 1) - bar.n)
        if done >= total:
            bar.close()

    return progress


class StatusLines:
    """`progress(done, total)` printing `jaxformer transcribe: 120/3600 s of audio (3%),
    25 s` on stderr, at most one line every `every` seconds of wall time (the first
    after `every` seconds: a short run prints none)."""

    def __init__(self, every: float = STATUS_EVERY_S, clock=time.monotonic, file=None):
        self.every, self.clock, self.file = every, clock, file
        self.start = self.last = clock()

    def __call__(self, done: float, total: float) -> None:
        now = self.clock()
        if now - self.last < self.every or done >= total:
            return
        self.last = now
        print(f"jaxformer transcribe: {done:.0f}/{total:.0f} s of audio "
              f"({100 * done / max(total, 1e-9):.0f}%), {now - self.start:.0f} s",
              file=self.file or sys.stderr, flush=True)

"""`jaxformer transcribe`: Whisper over WAV files (`jaxformer.models.whisper`).

    jaxformer transcribe --model DIR talk.wav            # the text
    jaxformer transcribe --model DIR a.wav b.wav --json  # one JSON line per file
    jaxformer transcribe --model DIR talk.wav --timestamps --format srt

DIR is a CTranslate2 Whisper folder (`model.bin`, `vocabulary.txt`,
`config.json`) or a Hugging Face Whisper directory (`config.json`,
safetensors, `tokenizer.json`). Any WAV sample rate and channel count; audio longer than 30 s
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

from jaxformer.cli.args import positive_int
from jaxformer.cli.usage import UsageError, require_positive

FORMATS = ("text", "json", "srt")
STATUS_EVERY_S = 10.0  # seconds between two status lines (no terminal, or --no-progress)


def add_parser(commands, add_common_flags) -> None:
    """Register the subcommand on `commands` (argparse subparsers)."""
    parser = commands.add_parser(
        "transcribe", help="speech to text with a Whisper model",
        description="Transcribe (or translate to English) WAV files with a Whisper "
                    "model (CTranslate2 or Hugging Face directory): any sample rate and channel count, any length.")
    parser.add_argument("audio", nargs="+", metavar="AUDIO", help="WAV files")
    parser.add_argument("--model", required=True, metavar="DIR",
                        help="a CTranslate2 Whisper folder (model.bin, vocabulary.txt, "
                             "config.json) or a Hugging Face Whisper directory")
    parser.add_argument("--language", default="auto",
                        help='"auto" (detected per file) or a code such as "en" (default auto)')
    parser.add_argument("--task", choices=("transcribe", "translate"), default="transcribe")
    parser.add_argument("--timestamps", action="store_true",
                        help="segment timestamps (Whisper's timestamp tokens)")
    parser.add_argument("--format", choices=FORMATS, default="text",
                        help="text, json (one line per file) or srt (default text)")
    parser.add_argument("--json", action="store_const", const="json", dest="format",
                        help="the same as --format json")
    parser.add_argument("--batch", type=positive_int, default=8,
                        help="30 s windows decoded together")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar on a terminal; as when stderr is not a "
                             f"terminal, a long run prints one status line every "
                             f"{STATUS_EVERY_S:g} s on stderr instead")
    add_common_flags(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    from jaxformer.models import whisper  # noqa: PLC0415

    from jaxformer.models.whisper import check_language_code  # noqa: PLC0415

    require_positive("--batch", args.batch)
    try:  # before the model is read
        check_language_code(args.language)
    except ValueError as error:
        raise UsageError(f"--language: {error}") from error
    if args.format == "srt" and not args.timestamps:
        raise UsageError("--format srt needs --timestamps")
    if not os.path.isdir(args.model):
        raise UsageError(f"--model {args.model}: not a directory (a CTranslate2 Whisper "
                              "folder with model.bin, vocabulary.txt and config.json, or a "
                              "Hugging Face Whisper directory)")
    try:
        samples = [whisper.open_wav(path) for path in args.audio]  # all checked first
        w = whisper.load(args.model)
        whisper.check_options(w, args.language, args.task)
        results = whisper.transcribe(w, samples, language=args.language, task=args.task,
                                        timestamps=args.timestamps, batch_size=args.batch,
                                        progress=_progress_bar(args))
    except ValueError as error:  # FileFormatError included
        raise UsageError(str(error)) from error
    for path, result in zip(args.audio, results):
        if args.format == "json":
            print(json.dumps({"file": path, **result.to_dict()}, ensure_ascii=False),
                  flush=True)
        elif args.format == "srt":
            print(whisper.srt(result.segments), end="", flush=True)
        else:
            prefix = f"{path}: " if len(args.audio) > 1 else ""
            print(prefix + whisper.to_text(result, args.timestamps), flush=True)
    return 0


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

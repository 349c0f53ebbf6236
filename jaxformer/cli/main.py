"""The `jaxformer` command (also `python -m jaxformer`): the parser and the dispatch.

    jaxformer train                       # copy task, copy_task model, Post-LN (cli.train)
    jaxformer train --task lm --data 'texts/*.txt'   # a byte-level LM on text files
    jaxformer generate --run runs/lm "def main("     # continue a prompt (cli.generate)
    jaxformer decode --run runs/copy "5 6 7"         # decode a source with a trained model
    jaxformer generate --model SmolLM2.gguf "The capital of France is"   # a pretrained LM
    jaxformer eval --model SmolLM2.gguf --data 'texts/*.txt'   # loss, perplexity (cli.evaluate)
    jaxformer transcribe --model DIR talk.wav        # speech to text (cli.transcribe)
    jaxformer export --run runs/lm --out my-lm-hf    # a Hugging Face directory (cli.export)
    jaxformer serve --model SmolLM2.gguf             # OpenAI-compatible HTTP API (cli.serve)
    jaxformer lm-eval --model jaxformer --model_args path=SmolLM2.gguf --tasks arc_easy

Each command is one module: `add_parser(commands, add_common_flags)` registers it,
its function runs it. Every command has --compile-cache and --verbose; a bad flag or
input is one line, exit status 2 (`cli.usage.UsageError`).

A Ctrl-C at any moment of a command (its imports included: they are `main`'s, not
this module's) is one line, `jaxformer COMMAND: interrupted by Ctrl-C`, and exit
status 130 (`cli.interrupts`); `train` saves a checkpoint on the first one.

Exit status: 0 done, 1 non-finite loss or a checkpoint that could not be written,
2 bad input or checkpoint, 130 interrupted by Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import Optional, Sequence

from jaxformer.cli.interrupts import (INTERRUPTED, end_process, ignore_interrupts,
                                      interrupts_deferred, interrupts_surface)
from jaxformer.cli.usage import UsageError


def build_parser() -> argparse.ArgumentParser:
    # The commands' modules here, not at the top: their imports (seconds of a start)
    # then run inside `main`, where a Ctrl-C is one line.
    from jaxformer.cli import args as args_lib  # noqa: PLC0415
    from jaxformer.cli import evaluate as evaluate_command  # noqa: PLC0415
    from jaxformer.cli import export as export_command  # noqa: PLC0415
    from jaxformer.cli import generate as generate_commands  # noqa: PLC0415
    from jaxformer.cli import lm_eval as lm_eval_command  # noqa: PLC0415
    from jaxformer.cli import serve as serve_command  # noqa: PLC0415
    from jaxformer.cli import train as train_command  # noqa: PLC0415
    from jaxformer.cli import transcribe as transcribe_command  # noqa: PLC0415

    parser = args_lib.Parser(
        prog="jaxformer", description="The Transformer in JAX/Flax: train on synthetic tasks "
                                      "or text, then decode with the trained model.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    train_command.add_parser(commands, _add_compile_cache_flag)
    generate_commands.add_parsers(commands, _add_compile_cache_flag)
    evaluate_command.add_parser(commands, _add_compile_cache_flag)
    transcribe_command.add_parser(commands, _add_compile_cache_flag)
    export_command.add_parser(commands, _add_compile_cache_flag)
    serve_command.add_parser(commands, _add_compile_cache_flag)
    lm_eval_command.add_parser(commands, _add_compile_cache_flag)
    return parser


def _add_compile_cache_flag(parser) -> None:
    """--compile-cache, and --verbose (every command has both)."""
    parser.add_argument("--compile-cache", metavar="DIR",
                        help="keep compiled programs in DIR (created if missing): a rerun "
                             "with the same shapes loads them instead of compiling "
                             "(default: $XDG_CACHE_HOME/jaxformer/xla, or "
                             "$JAXFORMER_COMPILE_CACHE; 'off' there disables it)")
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="compile everything afresh, keep nothing on disk")
    parser.add_argument("--verbose", action="store_true",
                        help="on an error, also print the traceback of its cause")


def _compile_cache(directory: Optional[str], disabled: bool = False):
    """The compile-cache context (`compile_cache.command_cache`: --compile-cache checked
    before anything runs, else the user's cache directory, or none)."""
    from jaxformer.cli.compile_cache import command_cache  # noqa: PLC0415
    try:
        return command_cache(directory, disabled)
    except ValueError as error:
        raise UsageError(str(error)) from error


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of `jaxformer` and `python -m jaxformer`; returns the exit status.

    `argv` None: the program's own command line, and its process: interrupted, it
    ends right after the line (`interrupts.end_process`); done, it ignores Ctrl-C
    while Python winds down. A list (a caller in Python): neither."""
    own_process = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    with interrupts_surface():  # a Ctrl-C inside a GC callback raises here too
        try:
            status = run_command(argv)
            if own_process:
                ignore_interrupts()
        except KeyboardInterrupt:  # anywhere: the imports, the work, a second Ctrl-C
            command = argv[0] if argv and not argv[0].startswith("-") else None
            print(f"jaxformer{f' {command}' if command else ''}: interrupted by Ctrl-C",
                  file=sys.stderr)
            if own_process:
                end_process(INTERRUPTED)
            return INTERRUPTED
    return status


def run_command(argv: list) -> int:
    """Parse `argv` and run its command: the exit status (UsageError: one line, 2)."""
    # JAX first, whole: interrupted while jaxlib's extension initialises, the process
    # crashes (SIGSEGV, SIGABRT) instead of raising KeyboardInterrupt.
    with interrupts_deferred():
        import jax  # noqa: F401, PLC0415
    parser = build_parser()
    if argv[:1] == ["lm-eval"]:  # every later argument is lm_eval's, its flags too
        argv = ["lm-eval", "--", *argv[1:]]
    try:  # a bad flag: one line (`args.Parser`), status 2; --help: status 0
        args = parser.parse_args(argv)
    except SystemExit as done:
        return done.code
    if args.command is None:
        parser.print_help()
        return 2
    try:
        with _compile_cache(args.compile_cache, args.no_compile_cache):
            return args.func(args)
    except UsageError as error:
        print(f"jaxformer {args.command}: error: {error}", file=sys.stderr)
        if args.verbose and error.__cause__ is not None:
            traceback.print_exception(error.__cause__)
        return 2


if __name__ == "__main__":
    sys.exit(main())

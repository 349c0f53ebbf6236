"""`jaxformer lm-eval`: lm-evaluation-harness's command line with the "jaxformer" model.

    jaxformer lm-eval --model jaxformer --model_args path=SmolLM2.gguf --tasks arc_easy
    jaxformer lm-eval ls tasks

Every argument goes to lm-eval's own command line (`lm_eval --help`) unchanged;
the command only registers `jaxformer.harness.JaxformerLM` as "jaxformer" first,
since lm-eval finds models in its own registry alone. Needs the `lm_eval` extra.
"""

from __future__ import annotations

import argparse
import sys

from jaxformer.cli.usage import UsageError


def add_parser(commands, add_common_flags) -> None:
    """Register the subcommand on `commands` (argparse subparsers)."""
    parser = commands.add_parser(
        "lm-eval", help="lm-evaluation-harness with the jaxformer model (lm_eval's flags)",
        description="Run EleutherAI's lm-evaluation-harness with jaxformer models: "
                    "`--model jaxformer --model_args path=CHECKPOINT`; every argument is "
                    "lm_eval's (see `jaxformer lm-eval --help` after the first argument, "
                    "or `lm_eval --help`).", add_help=False)
    parser.add_argument("lm_eval_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="lm_eval's arguments")
    parser.set_defaults(func=run, compile_cache=None, no_compile_cache=False, verbose=False)


def run(args) -> int:
    try:
        import lm_eval  # noqa: F401, PLC0415 - optional: the lm_eval extra
    except ImportError as error:
        raise UsageError("lm-eval needs lm-evaluation-harness: pip install "
                         "'jaxformer[lm_eval]'") from error
    import jaxformer.harness.lm_eval_model  # noqa: F401, PLC0415 - registers "jaxformer"
    from lm_eval.__main__ import cli_evaluate  # noqa: PLC0415

    forwarded = list(args.lm_eval_args)
    if forwarded[:1] == ["--"]:  # (main puts it there so that argparse keeps the flags)
        forwarded = forwarded[1:]
    check_jaxformer_args(forwarded)
    saved = sys.argv
    sys.argv = ["jaxformer lm-eval", *forwarded]  # lm-eval's parser reads sys.argv
    try:
        cli_evaluate()
    except (ValueError, KeyError, TypeError, OSError) as error:  # lm-eval's, the loader's
        # refusals; TypeError: a model argument the model does not take
        text = str(error.args[0] if isinstance(error, KeyError) and error.args else error)
        raise UsageError(text.strip().splitlines()[0] if text.strip() else
                         type(error).__name__) from error
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    finally:
        sys.argv = saved
    return 0


def check_jaxformer_args(forwarded: list[str]) -> None:
    """`--model jaxformer --model_args k=v,...`: the model arguments checked
    (`JaxformerLM.check_model_args`) before lm-eval spends seconds indexing its tasks."""
    from jaxformer.harness.lm_eval_model import check_model_args  # noqa: PLC0415
    from lm_eval.utils import simple_parse_args_string  # noqa: PLC0415

    def value(flag):
        for i, arg in enumerate(forwarded):
            if arg == flag and i + 1 < len(forwarded):
                return forwarded[i + 1]
            if arg.startswith(flag + "="):
                return arg[len(flag) + 1:]
        return None

    model_args = value("--model_args")
    if value("--model") != "jaxformer" or not model_args or model_args.lstrip().startswith("{"):
        return  # another model, or JSON arguments: lm-eval and the model check them
    try:
        check_model_args(simple_parse_args_string(model_args))
    except ValueError as error:
        raise UsageError(str(error)) from error

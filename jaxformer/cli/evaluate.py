"""`jaxformer eval`: held-out loss, perplexity and bits per byte of a causal LM.

    jaxformer eval --model SmolLM2.gguf --data 'texts/*.txt'
    jaxformer eval --run runs/lm --data held_out.txt --seq-len 256

Every file is one document: BOS, its tokens, EOS, packed into windows of
`--seq-len` tokens (`jaxformer.train.data`, documents never attend across each
other). The loss counts every predicted token of every window once; bits per
byte divide the total by the UTF-8 bytes those tokens stand for, so models with
different tokenizers compare. One JSON line at the end: loss, perplexity,
bits_per_byte, tokens, bytes, and tokens_per_s (scored tokens over the seconds of
the evaluation, its one compilation included; loading the model not).
"""

from __future__ import annotations

import json
import time

from jaxformer.cli.args import at_least, positive_int
from jaxformer.cli.runs import (add_cpu_tuning_flags, add_weights_flags, cpu_tuning,
                                language_model, weights_request)
from jaxformer.cli.usage import UsageError


def add_parser(commands, add_common_flags) -> None:
    """Register the subcommand on `commands` (argparse subparsers)."""
    parser = commands.add_parser(
        "eval", help="held-out loss, perplexity and bits per byte of a language model",
        description="Evaluate a pretrained language model (--model: a GGUF file or a "
                    "Hugging Face directory) or a --task lm run (--run) on text files.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", help="the run directory (--out of train)")
    source.add_argument("--model", metavar="PATH",
                        help="a GGUF file or a Hugging Face checkpoint directory")
    parser.add_argument("--data", action="append", required=True, metavar="PATH",
                        help="text file or glob, one document per file (repeatable)")
    parser.add_argument("--seq-len", type=at_least(2),
                        help="window length in tokens (default: the run's, or 512 capped "
                             "by the model's context)")
    parser.add_argument("--batch", type=positive_int, default=8, help="windows per batch (default 8)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_weights_flags(parser)
    add_cpu_tuning_flags(parser)
    add_common_flags(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    cpu_tuning(args.cpu_tuning)  # before JAX starts
    from jaxformer.train.data import TextData, document_paths  # noqa: PLC0415
    from jaxformer.train.evaluation import evaluate_lm  # noqa: PLC0415

    try:  # the files are there before the model loads (TextData reads them below)
        document_paths(args.data)
    except ValueError as error:
        raise UsageError(f"--data: {error}") from error
    model, params, tokenizer = language_model(args.run, args.model, weights_request(args))
    context = model.config.decoder_len
    seq_len = args.seq_len or min(512, context)
    if seq_len > context:
        raise UsageError(f"--seq-len {seq_len} is longer than the model's context of "
                         f"{context} tokens")
    try:  # every file is read and checked first; all of them are held out
        data = TextData(None, tokenizer, seq_len, eval_patterns=args.data)
    except ValueError as error:
        raise UsageError(str(error)) from error
    started = time.perf_counter()
    metrics = evaluate_lm(model, params, data, batch_size=args.batch,
                          progress=not args.no_progress)
    metrics["tokens_per_s"] = round(metrics["tokens"] / (time.perf_counter() - started), 1)
    print(json.dumps(metrics), flush=True)
    return 0

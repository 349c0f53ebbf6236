"""`jaxformer generate` and `jaxformer decode`: continue prompts with a language model,
decode sources with the model of a copy/reverse/sort run.

    jaxformer generate --run runs/lm "def main("     # continue a prompt with a trained LM
    jaxformer generate --model SmolLM2.gguf "The capital of France is"   # a pretrained LM
    jaxformer generate --model DIR --chat "Hi"       # a user message in the chat template
    jaxformer decode --run runs/copy "5 6 7"         # decode a source with a trained model
"""

from __future__ import annotations

import json
import time
from typing import Optional

from jaxformer.cli import args as args_lib
from jaxformer.cli.args import positive_int
from jaxformer.cli.chat import chat_prompts, read_template
from jaxformer.cli.runs import (add_cpu_tuning_flags, add_weights_flags, cpu_tuning,
                                language_model, load_run, weights_request)
from jaxformer.cli.streaming import TextStream
from jaxformer.cli.usage import UsageError

DEFAULT_NEW_TOKENS = 200  # generate/decode --max-new-tokens when not given


def add_parsers(commands, add_common_flags) -> None:
    """Register `generate` and `decode` on `commands` (argparse subparsers)."""
    generate = commands.add_parser(
        "generate", help="continue prompts with a pretrained LM or a `--task lm` run",
        description="Continue each prompt with a pretrained language model (--model: a "
                    "GGUF file or a Hugging Face directory; greedy by default) or the latest "
                    "checkpoint of a --task lm run (--run; sampled at 0.8 by default).")
    generate.add_argument("prompts", nargs="+", metavar="PROMPT")
    source = generate.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", help="the run directory (--out of train)")
    source.add_argument("--model", metavar="PATH",
                        help="a GGUF file or a Hugging Face checkpoint directory")
    generate.add_argument("--json", action="store_true",
                          help="one JSON line per prompt: prompt, ids (the new tokens), text, "
                               "seconds")
    generate.add_argument("--chat", action="store_true",
                          help="each prompt is a user message, formatted by the model's chat "
                               "template (--model)")
    generate.add_argument("--system", metavar="TEXT",
                          help="with --chat: a system message before each prompt")
    add_sampling_flags(generate, temperature=None)
    generate.add_argument("--prefill-chunk", type=positive_int, metavar="N",
                          help="fill the KV cache N prompt tokens at a time (bounded memory "
                               "for long prompts; default: the whole prompt in one pass)")
    add_weights_flags(generate)
    add_cpu_tuning_flags(generate)
    add_common_flags(generate)
    generate.set_defaults(func=generate_command)

    decode = commands.add_parser(
        "decode", help="decode sources with the model of a copy/reverse/sort run",
        description="Load the latest checkpoint of an encoder-decoder run and decode "
                    "sources given as space-separated token ids (default: held-out examples).")
    decode.add_argument("sources", nargs="*", metavar="IDS", help='e.g. "5 6 7"')
    decode.add_argument("--run", required=True, help="the run directory (--out of train)")
    decode.add_argument("--examples", type=positive_int, default=5,
                        help="held-out examples decoded when no source is given")
    add_sampling_flags(decode, temperature=0.0)
    add_common_flags(decode)
    decode.set_defaults(func=decode_command)


def add_sampling_flags(parser, *, temperature: Optional[float]) -> None:
    parser.add_argument("--max-new-tokens", type=positive_int, metavar="N",
                        help=f"tokens to generate per input (default {DEFAULT_NEW_TOKENS}, "
                             "fewer where the model's context has no room for them; a value "
                             "given beyond the context is refused)")
    parser.add_argument("--temperature", type=args_lib.non_negative_float, default=temperature,
                        help="0 = greedy (default " + (
                            f"{temperature})" if temperature is not None else
                            "0 with --model, 0.8 with --run)"))
    parser.add_argument("--top-k", type=positive_int, help="sample among the k likeliest tokens")
    parser.add_argument("--top-p", type=args_lib.probability,
                        help="sample in the nucleus of probability mass p, 0 < p <= 1")
    parser.add_argument("--seed", type=args_lib.seed, default=0,
                        help="sampling seed, 0 <= seed < 2**32")


def generate_command(args) -> int:
    cpu_tuning(args.cpu_tuning)  # before JAX starts
    if args.system is not None and not args.chat:
        raise UsageError("--system needs --chat")
    template = read_template(args.model, args.run) if args.chat else None
    model, params, tokenizer = language_model(args.run, args.model, weights_request(args))
    temperature = args.temperature if args.temperature is not None else (
        0.8 if args.run is not None else 0.0)
    if args.chat:
        prompts = chat_prompts(template, tokenizer, args.prompts, args.system)
    else:
        prompts = [tokenizer.encode_prompt(p).tolist() for p in args.prompts]
    for text, prompt in zip(args.prompts, prompts):
        if not prompt:
            raise UsageError(f"prompt {text!r} encodes to no tokens")
    max_new_tokens = new_token_budget(model.config.decoder_len, max(map(len, prompts)),
                                      args.max_new_tokens)
    # One prompt streams its text as the tokens come; a batch prints when it ends.
    # A chat prints the replies alone.
    shown = [""] * len(prompts) if args.chat else args.prompts
    stream = None if args.json or len(prompts) > 1 else TextStream(
        tokenizer, shown[0], stop={model.config.eos_id, model.config.pad_id})
    started = time.perf_counter()
    try:  # the flags were checked as parsed: the library's own checks are a backstop
        new_ids = continue_prompts(model, params, prompts, max_new_tokens,
                                   temperature=temperature, top_k=args.top_k,
                                   top_p=args.top_p, seed=args.seed,
                                   on_token=stream and stream.on_token,
                                   prefill_chunk=args.prefill_chunk)
    except (TypeError, ValueError) as error:
        raise UsageError(str(error)) from error
    seconds = round(time.perf_counter() - started, 3)
    for prompt, ids, before in zip(args.prompts, new_ids, shown):
        text = tokenizer.decode(ids)
        if args.json:
            print(json.dumps({"prompt": prompt, "ids": ids, "text": text,
                              "seconds": seconds}, ensure_ascii=False), flush=True)
        elif stream is not None:
            stream.finish(text)
        else:
            print(before + text, flush=True)
    return 0


def decode_command(args) -> int:
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from jaxformer.decode.api import greedy_decode, sample  # noqa: PLC0415
    from jaxformer.nn.model import Transformer  # noqa: PLC0415
    from jaxformer.train.task import training_task  # noqa: PLC0415

    try:  # before the checkpoint is read
        rows = [[int(t) for t in source.split()] for source in args.sources]
    except ValueError as error:
        raise UsageError(f"sources must be space-separated token ids: {error}") from error
    if not all(rows):
        raise UsageError("a source is empty")
    model_config, train_config, params = load_run(args.run, language_model=False)
    model = Transformer(model_config)
    kwargs = dict(max_new_tokens=new_token_budget(model_config.decoder_len, 1,
                                                  args.max_new_tokens))
    if rows:
        src = np.full((len(rows), max(map(len, rows))), model_config.pad_id, np.int32)
        for i, row in enumerate(rows):
            src[i, :len(row)] = row
    else:
        src = training_task(model_config, train_config).heldout_set(args.examples).src
    try:
        out = (greedy_decode(model, params, src, **kwargs) if args.temperature == 0 else
               sample(model, params, src, rng=jax.random.PRNGKey(args.seed),
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                      **kwargs))
    except (TypeError, ValueError) as error:
        raise UsageError(str(error)) from error
    stop = {model_config.pad_id}
    for row, tokens, n in zip(src, np.asarray(out.tokens), np.asarray(out.lengths)):
        source = " ".join(map(str, strip_at(row, stop)))
        decoded = " ".join(map(str, strip_at(tokens[:n], {model_config.eos_id, *stop})))
        print(f"{source}  ->  {decoded}")
    return 0


def strip_at(tokens, stop: set) -> list[int]:
    """Token ids up to (not including) the first of `stop`."""
    kept = []
    for token in tokens:
        if int(token) in stop:
            break
        kept.append(int(token))
    return kept


def new_token_budget(context: int, prompt_width: int, requested: Optional[int]) -> int:
    """How many tokens `generate` / `decode` ask for: --max-new-tokens as given, refused
    beyond what a prompt of `prompt_width` tokens leaves of the model's `context`
    (generation feeds back all but its last token); when not given, the default,
    capped there."""
    room = context - prompt_width + 1
    if room < 1:
        raise UsageError(f"a prompt of {prompt_width} tokens leaves no room in the model's "
                         f"context of {context} tokens (max_len)")
    if requested is None:
        return min(DEFAULT_NEW_TOKENS, room)
    if requested > room:
        raise UsageError(f"--max-new-tokens {requested} does not fit: the model's context "
                         f"is {context} tokens (max_len) and the "
                         + (f"longest prompt has {prompt_width}, which leaves {room}"
                            if prompt_width > 1 else f"most it generates is {room}"))
    return requested


def continue_prompts(model, params, prompts, max_new_tokens: int, *,
                     temperature: float = 0.8, top_k=None, top_p=None, seed: int = 0,
                     on_token=None, prefill_chunk=None) -> list[list[int]]:
    """Sampled (temperature 0: greedy) continuations of token prompts: the new ids,
    up to and without EOS. `max_new_tokens`: within the model's context
    (`new_token_budget`). `on_token(step, token_B)` is called with every step's picks
    as they come (`jaxformer.decode.stream.generate_stream`'s chunks: its programs
    hold no host callback, so the compilation cache keeps them across starts)."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from jaxformer.decode.api import generate  # noqa: PLC0415
    from jaxformer.decode.stream import generate_stream  # noqa: PLC0415

    width = max(len(p) for p in prompts)
    batch = np.full((len(prompts), width), model.config.pad_id, np.int32)
    for row, prompt in zip(batch, prompts):
        row[:len(prompt)] = prompt
    settings = dict(max_new_tokens=max_new_tokens,
                    prompt_lengths=np.array([len(p) for p in prompts], np.int32),
                    rng=jax.random.PRNGKey(seed), temperature=temperature, top_k=top_k,
                    top_p=top_p, prefill_chunk=prefill_chunk)
    if on_token is None:
        tokens = np.asarray(generate(model, params, batch, **settings).tokens)
    else:
        columns = []
        for chunk_Bk in generate_stream(model, params, batch, **settings):
            for token_B in chunk_Bk.T:
                on_token(len(columns), token_B)
                columns.append(token_B)
        tokens = np.stack(columns, axis=1)
    eos = model.config.eos_id
    # PAD follows a row's EOS: the ids before the first EOS
    return [[int(i) for i in row[:list(row).index(eos) if eos in row else len(row)]]
            for row in tokens]



"""`jaxformer serve`: an OpenAI-compatible HTTP server over the serving engine.

    jaxformer serve --model SmolLM2.gguf                       # http://127.0.0.1:8000/v1
    jaxformer serve --model runs/lm --port 9000 --api-key KEY
    jaxformer serve --model SmolLM2.gguf --lora poems=runs/poems --lora code=runs/code

--model is a GGUF file, a Hugging Face directory or a run directory of `jaxformer
train --task lm`. Each --lora NAME=RUN_DIR is a fine-tuned run of that model,
served beside it: a request whose `model` is NAME uses it (its LoRA merged in).
Routes, errors and limits: `jaxformer.serve.http`; metrics at /metrics.

By default a GGUF file's quantized blocks are served as they are (as llama.cpp
does; --dequantize: float32 weights) and, on a CPU, the process runs
`jaxformer.backends.cpu`'s tuning (--no-cpu-tuning: JAX's defaults). Once the
socket listens, one line goes to stdout: `serving NAME on http://HOST:PORT
(weights: kept GGUF blocks (int4, int8_block); CPU tuning on)` (or `float32`,
`quantized (int8)`; `off`). --warm-up compiles every program the engine's steps
use before it listens (`Engine.warm_up`); without it each is compiled at its first
use. --scan-layers runs the decoder layers as one scan (`Engine(scan_layers=True)`):
each program compiles faster and holds a fraction of the memory, for a slower step
with float weights; it is the default with quantized layers that are all alike
(--no-scan-layers to unroll). SIGTERM or Ctrl-C: no new connections, running
requests finish for at most --drain-timeout seconds (then each stream still open
ends with an error event and [DONE], each answer awaited with a 503), exit 0.
"""

from __future__ import annotations

import argparse
import os
import socket

from jaxformer.cli.args import non_negative_float, non_negative_int, positive_int
from jaxformer.cli.runs import (add_cpu_tuning_flags, add_weights_flags, cpu_tuning,
                                describe_weights, language_model, load_run, open_run,
                                weights_request)
from jaxformer.cli.usage import UsageError

DEFAULT_MAX_LEN = 2048  # --max-len when not given (capped by the model's context)


def port(text: str) -> int:
    """An argparse type: a TCP port, 1..65535."""
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 1..65535, got {text}")
    return value


def lora_spec(text: str) -> tuple[str, str]:
    """An argparse type: NAME=RUN_DIR, the directory existing."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"must be NAME=RUN_DIR, got {text!r}")
    if not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path} is not a directory (a run of jaxformer "
                                         "train)")
    return name, path


def add_parser(commands, add_common_flags) -> None:
    """Register the subcommand on `commands` (argparse subparsers)."""
    parser = commands.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming)",
        description="Serve a language model over HTTP with the OpenAI API: continuous "
                    "batching over a paged KV cache (jaxformer.serve).")
    parser.add_argument("--model", required=True, metavar="PATH",
                        help="a GGUF file, a Hugging Face directory or a run directory "
                             "(jaxformer train --task lm)")
    parser.add_argument("--name", help="the model's name in the API (default: the file or "
                                       "directory name)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=port, default=8000, help="TCP port (default 8000)")
    parser.add_argument("--slots", type=positive_int, default=8,
                        help="requests decoded together (default 8)")
    parser.add_argument("--max-len", type=positive_int, metavar="TOKENS",
                        help=f"context per request, prompt + new tokens (default "
                             f"{DEFAULT_MAX_LEN}, capped by the model's)")
    parser.add_argument("--page-size", type=positive_int, default=16,
                        help="tokens per KV-cache page (default 16)")
    parser.add_argument("--num-pages", type=positive_int,
                        help="pages in the KV pool (default: every slot's whole context)")
    parser.add_argument("--prefill-chunk", type=positive_int, default=128,
                        help="most prompt tokens read per engine step (default 128)")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="do not share the KV pages of common prompt prefixes")
    parser.add_argument("--max-queue", type=positive_int, default=64,
                        help="waiting requests beyond which the server answers 429 "
                             "(default 64)")
    parser.add_argument("--speculative", type=non_negative_int, default=0, metavar="K",
                        help="prompt-lookup speculation: draft up to K tokens per request "
                             "and step from its prompt and output, verified in the step's "
                             "one pass (greedy output unchanged; default 0 = off)")
    parser.add_argument("--warm-up", action="store_true",
                        help="compile every decode and prefill program before listening, so "
                             "no request waits for a compile (one per view length: minutes "
                             "and ~50 MB of memory each for a 30-layer model on a CPU)")
    parser.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
                        help="run the decoder layers as one scan over stacked weights: each "
                             "program compiles ~2x faster and holds ~10 MB instead of ~50-100 "
                             "(SmolLM2, CPU); the step copies each layer's weights out of the "
                             "stack, ~1.4x slower at 8 slots for float weights, even for "
                             "quantized ones (default: scanned with quantized layers, else "
                             "unrolled)")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ routes")
    parser.add_argument("--lora", action="append", type=lora_spec, default=[],
                        metavar="NAME=RUN_DIR",
                        help="also serve a fine-tuned run of --model as model NAME "
                             "(repeatable)")
    parser.add_argument("--drain-timeout", type=non_negative_float, default=30.0,
                        metavar="SECONDS",
                        help="on SIGTERM, how long running requests may finish (default 30)")
    add_weights_flags(parser)
    add_cpu_tuning_flags(parser)
    add_common_flags(parser)
    parser.set_defaults(func=run)


def is_run_directory(path: str) -> bool:
    """A run of `jaxformer train` (config.json and checkpoints/), not a Hugging Face folder."""
    return os.path.isdir(os.path.join(path, "checkpoints"))


def check_port(host: str, number: int) -> None:
    """UsageError if HOST:PORT cannot be listened on (checked before the model loads)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, number))
    except OSError as error:
        raise UsageError(f"--host {host} --port {number}: cannot listen there "
                         f"({error.strerror or error})") from error


def check_first(args) -> None:
    """Everything that needs no model: the serve extra, the --lora runs, the port."""
    try:
        import starlette  # noqa: F401, PLC0415
        import uvicorn  # noqa: F401, PLC0415
    except ImportError as error:
        raise UsageError(f"serving needs {error.name} (pip install 'jaxformer[serve]')"
                         ) from error
    names = [name for name, _ in args.lora]
    if len(set(names)) != len(names):
        raise UsageError(f"--lora: a name given twice ({', '.join(names)})")
    if args.name is not None and args.name in names:
        raise UsageError(f"--lora {args.name}: the name of --model itself")
    for name, path in args.lora:
        run = open_run(path, f"--lora {name}: ")
        if not run.trains_language_model:
            raise UsageError(f"--lora {name}: {path} is a {run.train_config.task} run, not "
                             "a language model")
    check_port(args.host, args.port)


def base_model(args):
    """(model, params, tokenizer, chat template) of --model, a run's LoRA merged in."""
    from jaxformer.nn.lora import merge_lora  # noqa: PLC0415
    from jaxformer.nn.model import DecoderOnlyLM  # noqa: PLC0415
    from jaxformer.text import chat_template  # noqa: PLC0415

    if is_run_directory(args.model):
        model, params, tokenizer = language_model(args.model, None, weights_request(args))
        config, params = merge_lora(model.config, params)
        model, template = DecoderOnlyLM(config), open_run(args.model).chat_template()
    else:
        model, params, tokenizer = language_model(None, args.model, weights_request(args))
        try:
            template = chat_template(args.model)
        except ValueError as error:
            raise UsageError(str(error)) from error
    return model, params, tokenizer, template


def lora_adapters(args, model, params) -> dict:
    """{NAME: parameters} of each --lora NAME=RUN_DIR, its structure checked against --model's."""
    from jaxformer.serve.adapters import adapter_params, check_same_structure  # noqa: PLC0415

    adapters = {}
    for lora_name, path in args.lora:
        run_config, _, run_params = load_run(path, language_model=True)
        try:
            tree = adapter_params(model, run_config, run_params)
            check_same_structure(params, tree, f"--lora {lora_name} ({path})")
        except ValueError as error:
            raise UsageError(str(error)) from error
        adapters[lora_name] = tree
    return adapters


def scan_layers(args, config) -> bool:
    """--scan-layers as given, else scanned when the layer kernels are quantized (a GGUF
    file's kept blocks, --quantize) and alike (`serve.checks.scan_refusal`: one layer kind, no
    kernel of its own layout): their per-layer slice is then small enough that the scan
    costs nothing per step, and it halves the idle memory (benchmarks/NOTES.md, fifth
    session: SmolLM2 Q4_1 tuned, c1 88.6 against 63.0 tokens/s, c32 122.9 against 126.8,
    idle 512 against 800 MB)."""
    from jaxformer.serve.checks import scan_refusal  # noqa: PLC0415

    if args.scan_layers is not None:
        return args.scan_layers
    return config.weight_quant is not None and scan_refusal(config) is None


def run(args) -> int:
    tuned = cpu_tuning(args.cpu_tuning)  # before JAX starts
    from jaxformer.serve import ServedModel, create_app, run_server  # noqa: PLC0415
    from jaxformer.serve.http import structured_output  # noqa: PLC0415
    from jaxformer.serve.engine import Engine  # noqa: PLC0415
    import jax  # noqa: PLC0415
    from jaxformer.backends import host_memory  # noqa: PLC0415

    check_first(args)
    name = args.name or os.path.basename(os.path.normpath(args.model))
    model, params, tokenizer, template = base_model(args)
    weights = describe_weights(model.config, weights_request(args))
    context = model.config.decoder_len
    max_len = args.max_len or min(DEFAULT_MAX_LEN, context)
    if max_len > context:
        raise UsageError(f"--max-len {max_len} is longer than the model's context of "
                         f"{context} tokens")
    adapters = lora_adapters(args, model, params)
    try:
        engine = Engine(model, params, tokenizer, slots=args.slots, max_len=max_len,
                        page_size=args.page_size, num_pages=args.num_pages,
                        prefill_chunk=args.prefill_chunk,
                        prefix_cache=not args.no_prefix_cache, max_queue=args.max_queue,
                        adapters=adapters, speculative=args.speculative,
                        scan_layers=scan_layers(args, model.config))
    except ValueError as error:
        raise UsageError(str(error)) from error
    adapter_names = tuple(adapters)
    del params, adapters  # the engine holds its own (stacked, with --scan-layers) copies
    # The eager programs of loading and of the engine's layout never run again: ~50 MB
    # of compiled code on SmolLM2 (benchmarks/NOTES.md, the served model's memory).
    jax.clear_caches()
    host_memory.release_freed()
    if args.warm_up:
        engine.warm_up()  # every steady-state program compiled before the socket listens
    served = ServedModel(engine, tokenizer, name=name, max_len=max_len,
                         adapters=adapter_names, chat_template=template,
                         make_constraint=structured_output(
                             tokenizer, vocab_size=model.config.tgt_vocab_size,
                             eos_id=model.config.eos_id),
                         drain_timeout=args.drain_timeout)
    app = create_app(served, api_key=args.api_key)
    run_server(app, host=args.host, port=args.port, drain_timeout=args.drain_timeout,
               ready_line=ready_line(args, name, weights, tuned),
               on_drain_timeout=app.state.api.end_open_requests)
    return 0


def ready_line(args, name: str, weights: str, tuned: bool) -> str:
    """The line printed once the socket listens: the address, the weights served
    (`describe_weights`) and whether the CPU tuning is on."""
    host = f"[{args.host}]" if ":" in args.host else args.host
    return (f"serving {name} on http://{host}:{args.port} (weights: {weights}; "
            f"CPU tuning {'on' if tuned else 'off'})")

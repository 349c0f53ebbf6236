"""The command line's view of models: run directories of `jaxformer train`
(`jaxformer.train.run.Run`) and pretrained language models (`jaxformer.models.load`)
behind one interface, what is wrong with either as one-line UsageErrors."""

from __future__ import annotations

import argparse
import os

from jaxformer.cli.usage import UsageError


def open_run(run_dir: str, context: str = ""):
    """The `jaxformer.train.run.Run` of `run_dir`; what is wrong with it as one line."""
    from jaxformer.train.run import Run, RunError  # noqa: PLC0415

    try:
        return Run.open(run_dir)
    except RunError as error:
        raise UsageError(f"{context}{error}") from error


def load_run(run_dir: str, *, language_model: bool):
    """(model config, train config, params of the latest checkpoint) of a run directory.

    `language_model`: the command needs a decoder-only LM run (else a seq2seq one).
    """
    from jaxformer.train.checkpoint import CheckpointError  # noqa: PLC0415
    from jaxformer.train.run import RunError  # noqa: PLC0415

    run = open_run(run_dir)
    if run.trains_language_model != language_model:
        want = "a --task lm run" if language_model else "a copy/reverse/sort run"
        raise UsageError(f"{run_dir} is a {run.train_config.task} run; this command needs "
                         f"{want}")
    try:
        return run.model_config, run.train_config, run.latest_params()
    except (RunError, CheckpointError) as error:
        raise UsageError(str(error)) from error


def run_tokenizer(run):
    """`run.tokenizer()` (the tokenizer an LM run trains with), as one line if it fails."""
    from jaxformer.train.run import RunError  # noqa: PLC0415

    try:
        return run.tokenizer()
    except RunError as error:
        raise UsageError(str(error)) from error


QUANTIZE = ("int8", "int4", "int4_sym", "int8_block", "keep")


def add_quantize_flag(parser, what: str = "") -> None:
    parser.add_argument("--quantize", choices=QUANTIZE,
                        help=what + "hold the weights quantized (weight-only): int8 per channel, int4 "
                             "blocks of 32 (GGUF Q4_1's layout), ...; keep: a GGUF file's "
                             "Q8_0/Q4_0/Q4_1 blocks as they are")


def add_weights_flags(parser) -> None:
    """--quantize or --dequantize, for the commands that run a language model (generate,
    eval, serve): a GGUF file's quantized blocks are kept unless --dequantize asks for
    float32 (`weights_request`)."""
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--quantize", choices=QUANTIZE,
                        help="hold the weights quantized (weight-only): int8 per channel, "
                             "int4 blocks of 32 (GGUF Q4_1's layout), ...; keep: a GGUF "
                             "file's blocks as they are (the default for a quantized GGUF "
                             "file)")
    choice.add_argument("--dequantize", action="store_true",
                        help="a GGUF file's quantized blocks dequantized to float32 weights "
                             "(default: kept as they are, as llama.cpp runs them; a float "
                             "GGUF file or a Hugging Face directory is float either way)")


def weights_request(args):
    """What `language_model` is asked to load: --quantize as given, None (float) with
    --dequantize, else "auto" (a quantized GGUF file's blocks kept, anything else float:
    `jaxformer.models.load`)."""
    if args.quantize is not None:
        return args.quantize
    return None if args.dequantize else "auto"


def add_cpu_tuning_flags(parser) -> None:
    """--cpu-tuning / --no-cpu-tuning (dest cpu_tuning, on by default), as `train`'s."""
    parser.add_argument("--cpu-tuning", action=argparse.BooleanOptionalAction, default=True,
                        help="on a CPU (the default there), jaxformer.backends.cpu's tuning: "
                             "quantized weights run through its C++ integer kernel, decode "
                             "loops in its compiler settings; glibc keeps freed memory "
                             "(more resident memory); --no-cpu-tuning leaves JAX's defaults")


def describe_weights(config, request) -> str:
    """The weights a loaded model runs, in words: "kept GGUF blocks (int4, q6_k)",
    "quantized int8" or its float dtype ("float32")."""
    layouts = {config.weight_quant, config.quant_format("embed"),
               *(layout for _, layout in config.quant_layouts)} - {None, "float"}
    if not layouts:
        return str(config.param_dtype)
    names = ", ".join(sorted(layouts))
    return f"kept GGUF blocks ({names})" if request in ("auto", "keep") else \
        f"quantized ({names})"


def cpu_tuning(wanted: bool) -> bool:
    """Ask for CPU tuning (`backends.cpu.tune_process`: its allocator and dispatch
    settings; quantized weights then run through its C++ kernel) if `wanted` and JAX
    will run on the CPU; True if it is on. Call it before JAX starts."""
    from jaxformer.backends import cpu  # noqa: PLC0415

    if not wanted or not cpu.cpu_is_the_backend():
        return False
    try:
        cpu.tune_process()
    except cpu.CPUTuningError:  # JAX started already (a caller of main() in-process)
        return False
    return True


def load_pretrained(model_path, flag: str = "--model", quantize=None):
    """(DecoderOnlyLM, params, `tokenizers.Tokenizer`) of a Hugging Face directory or a
    GGUF file (`jaxformer.models.load`, `quantize` as it takes it), with UsageErrors
    for what is wrong with it."""
    from jaxformer.models import load  # noqa: PLC0415
    from jaxformer.nn.model import DecoderOnlyLM  # noqa: PLC0415

    try:
        # quantize only when asked: the plain call stays `load(path)`
        model, params, tokenizer = load(model_path, **(
            {} if quantize is None else {"quantize": quantize}))
    except ImportError as error:
        raise UsageError(f"{flag} {model_path}: {error} (pip install 'jaxformer[llm]')") from error
    except ValueError as error:  # FileFormatError, unsupported architectures and values
        raise UsageError(str(error)) from error
    if not isinstance(model, DecoderOnlyLM):
        raise UsageError(f"{flag} {model_path}: an encoder-decoder "
                         f"({type(model).__name__}); this command takes a decoder-only LM "
                         "(a Whisper directory: jaxformer transcribe)")
    if tokenizer is None:
        raise UsageError(f"{flag} {model_path}: no tokenizer.json beside the weights")
    return model, params, tokenizer


def language_model(run_dir=None, model_path=None, quantize=None):
    """(DecoderOnlyLM, params, tokenizer) of a `--task lm` run (`run_dir`) or of a
    pretrained checkpoint (`model_path`: a Hugging Face directory or a GGUF file);
    `quantize` (`--quantize`): its kernels quantized, weight-only; "auto" (the
    commands' default, `weights_request`): a GGUF file's quantized blocks kept, else
    float.

    The tokenizer has the interface of `jaxformer.train.data` (encode to an id
    array without specials, decode, pad/bos/eos ids, byte_count).
    """
    from jaxformer.nn.model import DecoderOnlyLM  # noqa: PLC0415
    from jaxformer.text import JSONTokenizer  # noqa: PLC0415

    if run_dir is not None:
        if quantize == "auto":  # a run's weights are as it saved them
            quantize = None
        if quantize == "keep":
            raise UsageError("--quantize keep keeps a GGUF file's blocks (--model); a run's "
                             "weights are float: --quantize int8 or int4")
        model_config, train_config, params = load_run(run_dir, language_model=True)
        if quantize is not None:
            from jaxformer.nn.quant_params import quantize_params  # noqa: PLC0415

            try:
                model_config, params = quantize_params(model_config, params, quantize)
            except ValueError as error:
                raise UsageError(f"--quantize {quantize}: {error}") from error
        return DecoderOnlyLM(model_config), params, run_tokenizer(open_run(run_dir))
    model, params, tokenizer = load_pretrained(model_path, quantize=quantize)
    c = model.config
    return model, params, JSONTokenizer.wrap(tokenizer, pad_id=c.pad_id, bos_id=c.bos_id,
                                             eos_id=c.eos_id, vocab_size=c.tgt_vocab_size,
                                             name=os.fspath(model_path))

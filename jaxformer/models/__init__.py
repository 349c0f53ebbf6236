"""Per-model configurations and weight mappings built from jaxformer's blocks (no new layers)."""

__all__ = ["audio", "llama", "transcribe", "whisper"]

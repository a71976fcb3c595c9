"""The models a several-model server knows: each one's served name, where it comes from and
the `llamaserve serve` flags its own process gets, gathered from repeated `--model`, a
`--models-dir` and a `--models-config` TOML file.

Plain values, read once at start-up: which of them are loaded is pool.py's business.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from model.checkpoint.pypi_models import PYPI_DIRECTORIES, PYPI_MODELS
from server.startup.flags import UsageError

# Files and folders a models directory may hold: GGUF files, and directories of a
# checkpoint (HF safetensors with config.json, Meta `params.json`).
_DIRECTORY_MARKERS = ("config.json", "params.json")


@dataclass(frozen=True)
class ModelSpec:
    name: str  # the name clients send as `model`
    source: str  # a path or a PyPI model name, as `llamaserve serve MODEL` takes it
    flags: tuple[str, ...] = ()  # this model's own flags, after the shared ones
    load_at_start: bool = False


@dataclass
class Catalog:
    models: dict[str, ModelSpec] = field(default_factory=dict)

    def add(self, spec: ModelSpec, origin: str) -> None:
        if spec.name in self.models and self.models[spec.name].source != spec.source:
            raise UsageError(
                f"{origin}: the name {spec.name!r} is already taken by "
                f"{self.models[spec.name].source}; give one a `name` in --models-config"
            )
        self.models[spec.name] = spec


def served_name(source: str) -> str:
    """A GGUF file's stem, a directory's name, a PyPI model's own name."""
    if source in PYPI_MODELS or source in PYPI_DIRECTORIES:
        return source
    path = Path(source)
    return path.stem if path.suffix == ".gguf" else path.name


def directory_models(directory: str) -> list[ModelSpec]:
    root = Path(directory)
    if not root.is_dir():
        raise UsageError(f"--models-dir {directory} is not a directory")
    specs = []
    for entry in sorted(root.iterdir()):
        is_gguf = entry.is_file() and entry.suffix == ".gguf"
        is_checkpoint = entry.is_dir() and any((entry / m).exists() for m in _DIRECTORY_MARKERS)
        if is_gguf or is_checkpoint:
            specs.append(ModelSpec(served_name(str(entry)), str(entry)))
    return specs


def flag_words(flags: dict[str, object], origin: str) -> tuple[str, ...]:
    """A TOML table of flags as argv words: `max-model-len = 512` is `--max-model-len 512`,
    `true` the bare flag, `false` nothing, a list several values."""
    words: list[str] = []
    for key, value in flags.items():
        if value is False:
            continue
        words.append(f"--{key.removeprefix('--')}")
        if value is True:
            continue
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, dict | list) for v in values):
            raise UsageError(f"{origin}: flag {key!r} takes a value, a list of values or a boolean")
        words += [str(v) for v in values]
    return tuple(words)


def config_models(path: str) -> list[ModelSpec]:
    """[models.NAME] tables: `model` (path or PyPI name; a relative path is read from the
    file's folder), optional `flags` (a table) and `load_at_start`."""
    try:
        document = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"--models-config {path} cannot be read: {exc}") from None
    tables = document.get("models")
    if not isinstance(tables, dict) or not tables:
        raise UsageError(f"--models-config {path} has no [models.NAME] table")
    specs = []
    for name, table in tables.items():
        origin = f"--models-config {path}: [models.{name}]"
        if not isinstance(table, dict) or not isinstance(table.get("model"), str):
            raise UsageError(f"{origin} needs `model`, a path or a PyPI model name")
        unknown = set(table) - {"model", "flags", "load_at_start"}
        if unknown:
            raise UsageError(f"{origin}: unknown keys {sorted(unknown)}")
        source = table["model"]
        if source not in PYPI_MODELS and source not in PYPI_DIRECTORIES:
            source = str((Path(path).parent / source).resolve())
        flags = table.get("flags", {})
        if not isinstance(flags, dict):
            raise UsageError(f"{origin}: `flags` must be a table")
        at_start = table.get("load_at_start", False)
        specs.append(ModelSpec(name, source, flag_words(flags, origin), bool(at_start)))
    return specs


def build_catalog(
    models: list[str], models_dir: str | None, models_config: str | None, load_at_start: bool
) -> Catalog:
    catalog = Catalog()
    for source in models:
        catalog.add(ModelSpec(served_name(source), source), "--model")
    if models_dir is not None:
        for spec in directory_models(models_dir):
            catalog.add(spec, f"--models-dir {models_dir}")
    if models_config is not None:
        for spec in config_models(models_config):
            # The config file's entry wins over the same model found by --model or the folder.
            catalog.models.pop(spec.name, None)
            catalog.add(spec, f"--models-config {models_config}")
    if not catalog.models:
        raise UsageError("no model to serve: --models-dir holds no GGUF file or checkpoint")
    if load_at_start:
        catalog.models = {
            n: ModelSpec(s.name, s.source, s.flags, True) for n, s in catalog.models.items()
        }
    return catalog

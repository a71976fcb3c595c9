"""The C matmul kernels in both builds a machine may get: the one `model/native/build.py`
makes here, and the portable loop an AVX2-only CPU compiles (built here without AVX-512
BF16 and VNNI), for tests to run the same checks on each."""

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from model.native.build import COMPILE_FLAGS, HERE, LINK_FLAGS


def portable_library(source: str, tmp_path: Path) -> ctypes.CDLL:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    obj, target = tmp_path / "portable.o", tmp_path / "portable.so"
    # Compiled and linked in two steps as build.py does: linked with fast math, the
    # library would turn on flush-to-zero for the whole test process.
    without = ["-mno-avx512bf16", "-mno-avx512vnni"]
    compile_ = [compiler, *COMPILE_FLAGS, *without, "-c", "-o", str(obj)]
    if subprocess.run([*compile_, str(HERE / source)], check=False).returncode:
        pytest.skip("this compiler has no -mno-avx512bf16 (not x86)")
    subprocess.run([compiler, *LINK_FLAGS, "-o", str(target), str(obj), "-lm"], check=True)
    return ctypes.CDLL(str(target))


def kernel_build(cls: type, source: str, build: str, tmp_path_factory):
    """`cls` (a _TiledMatmul of model/native/ops.py) on the build named `build`."""
    if build == "native":
        return cls()
    kernel = cls(portable_library(source, tmp_path_factory.mktemp("portable")))
    assert kernel.kind == "portable"
    return kernel

"""The C kernels at every instruction level this machine can execute (model/native/build.py):
its own, AVX-512 without BF16 and VNNI, AVX2 and baseline x86-64, each taking other loops,
so a machine runs the checks an AVX2-only CPU would run as well as its own."""

import ctypes
import os

import pytest

from model.native.build import NativeUnavailable, executable_isas, library_for

ISAS = executable_isas()
# The levels the engine-wide invariance tests run at: each machine class we serve on
# (AVX-512 machines build `native`, AVX2-only ones `avx2`). The portable build's kernels
# are checked row by row at every level like the others; its engine-wide run (75 s on two
# cores) is left out, as no processor we serve on lacks AVX2.
MACHINE_ISAS = tuple(isa for isa in ISAS if isa in ("native", "avx2"))


def library_at(isa: str) -> ctypes.CDLL:
    """The library built for `isa`; skipped where no compiler builds it, except under CI,
    whose script installs one."""
    try:
        return library_for(isa)
    except NativeUnavailable:
        if os.environ.get("CI"):
            raise
        pytest.skip("the C kernels cannot be built here")


def kernel_build(cls: type, isa: str):
    """`cls` (a _TiledMatmul of model/native/ops.py) on the build for `isa`."""
    return cls(library_at(isa))


@pytest.fixture
def cpu_isa(request, monkeypatch) -> str:
    """Every library loaded while the test runs is the build for `request.param`."""
    library_at(request.param)
    monkeypatch.setenv("LLAMASERVE_CPU_ISA", request.param)
    return request.param

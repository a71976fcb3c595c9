"""bench/amx_probe.py: the compiler flags that build llama-server without AMX where the
compiler's AMX code faults, checked against the system's compiler itself."""

import shutil
import subprocess

import pytest

from bench.amx_probe import WITHOUT_AMX

# A level that has AMX on any machine (only the preprocessor runs: nothing executes).
AMX_LEVEL = "-march=sapphirerapids"


def _macros(*flags: str) -> str:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    command = [compiler, *flags, "-dM", "-E", "-x", "c", "-"]
    return subprocess.run(command, input="", capture_output=True, text=True, check=True).stdout


def test_without_amx_wins_over_march_on_either_side() -> None:
    """llama.cpp adds -march=native after the flags CMake starts from: the -mno-* flags must
    still leave every AMX macro undefined, and the rest of the level as it was."""
    assert "__AMX_TILE__" in _macros(AMX_LEVEL)
    flags = WITHOUT_AMX.split()
    for order in ((*flags, AMX_LEVEL), (AMX_LEVEL, *flags)):
        macros = _macros(*order)
        assert "__AMX" not in macros, order
        assert "__AVX512BF16__" in macros and "__AVX512VNNI__" in macros, order

"""The C kernels' instruction levels (model/native/build.py): which levels a CPU executes,
LLAMASERVE_CPU_ISA choosing one, and each build holding only its level's instructions, read
back from the machine code with objdump."""

import platform
import shutil
import subprocess

import pytest

from model.attention import attention_backend
from model.native import build
from model.native.int6_a8 import NativeInt6A8Matmul
from model.native.mxfp4 import NativeMxfp4Matmul
from model.native.ops import NativeInt4Matmul, NativeInt8Matmul
from tests.native_builds import ISAS, library_at

X86 = platform.machine() in ("x86_64", "AMD64")
# /proc/cpuinfo flags of a 2-core AMD EPYC Zen 3 (AVX2, no AVX-512), the ones that matter.
ZEN3_FLAGS = "fpu sse sse2 ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c"
ZEN3_FLAGS += " abm bmi1 avx2 bmi2 sha_ni"


def test_an_avx2_only_cpu_executes_avx2_and_portable(monkeypatch) -> None:
    if not X86:
        pytest.skip("instruction levels are x86-64's")
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset(ZEN3_FLAGS.split()))
    assert build.executable_isas() == ("native", "avx2", "portable")
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset({"sse2"}))
    assert build.executable_isas() == ("native", "portable")


def test_the_setting_chooses_the_build(monkeypatch) -> None:
    if "avx2" not in ISAS:
        pytest.skip("this CPU executes no AVX2 build")
    library_at("avx2")
    monkeypatch.setenv(build.ISA_ENV, "avx2")
    assert build.load_library() is build.library_for("avx2")
    # No AVX-512 BF16 at x86-64-v3: the int4 matmul takes its AVX2 loop.
    assert NativeInt4Matmul().kind == "avx2"
    monkeypatch.delenv(build.ISA_ENV)
    assert build.load_library() is build.library_for("native")


@pytest.mark.parametrize("kernel", [NativeInt4Matmul, NativeInt8Matmul, NativeInt6A8Matmul])
def test_each_level_takes_its_own_matmul_loop(kernel: type) -> None:
    kinds = {isa: kernel(library_at(isa)).kind for isa in ISAS}
    assert kinds.get("avx2", "avx2") == "avx2"
    assert kinds.get("portable", "portable") == "portable"
    assert kinds.get("avx512", "avx2") == "avx2"  # x86-64-v4: AVX2, but no AVX-512 BF16


def test_w6a8_takes_vpdpbusd_where_the_cpu_has_avx512_vnni() -> None:
    kinds = {isa: NativeInt6A8Matmul(library_at(isa)).kind for isa in ISAS}
    vnni = {"avx512_vnni", "avx512bw"} <= build.cpu_flags()
    assert kinds.get("native") == ("avx512_vnni" if vnni else kinds.get("native"))
    assert kinds.get("avx512", "avx2") == "avx2"  # x86-64-v4 has no VNNI


def test_each_level_takes_its_own_mxfp4_loop() -> None:
    kinds = {isa: NativeMxfp4Matmul(library_at(isa)).kind for isa in ISAS}
    assert kinds.get("avx512", "avx512") == "avx512"  # AVX-512F's 16-entry vpermps
    assert kinds.get("avx2", "avx2") == "avx2"
    assert kinds.get("portable", "portable") == "portable"
    # bf16 rows: dpbf16 where the build has AVX-512 BF16 and VBMI (x86-64-v4 has neither).
    bf16 = {isa: NativeMxfp4Matmul(library_at(isa)).bf16_kind for isa in ISAS}
    dpbf16 = {"avx512_bf16", "avx512vbmi"} <= build.cpu_flags()
    assert bf16.get("native") == ("avx512_bf16" if dpbf16 else kinds.get("native"))
    assert all(bf16[isa] == kinds[isa] for isa in ISAS if isa != "native")
    # With int8 activations: vpdpbusd where the level has AVX-512 VNNI (x86-64-v4 has not).
    a8 = {isa: NativeMxfp4Matmul(library_at(isa), int8_activations=True).kind for isa in ISAS}
    vnni = "avx512_vnni" if "avx512_vnni" in build.cpu_flags() else a8.get("native")
    assert a8.get("native") == vnni
    assert a8.get("avx512", "avx2") == a8.get("avx2", "avx2") == "avx2"
    assert a8.get("portable", "portable") == "portable"


def test_an_unknown_level_is_refused_and_the_reference_serves(monkeypatch, caplog) -> None:
    monkeypatch.setenv(build.ISA_ENV, "avx9000")
    with pytest.raises(build.NativeUnavailable, match="choose one of native, avx512"):
        build.load_library()
    assert attention_backend("auto", "cpu").name == "torch_ref"
    assert "avx9000" in caplog.text


def test_a_level_this_cpu_cannot_execute_is_refused(monkeypatch) -> None:
    if not X86:
        pytest.skip("instruction levels are x86-64's")
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset({"sse2"}))
    monkeypatch.setenv(build.ISA_ENV, "avx2")
    with pytest.raises(build.NativeUnavailable, match="cannot execute"):
        build.load_library()


# The widest registers each level may name: AVX2 code must not touch zmm, baseline x86-64
# neither ymm nor zmm.
FORBIDDEN = {"avx2": ("zmm",), "portable": ("ymm", "zmm")}


@pytest.mark.parametrize("level", sorted(FORBIDDEN))
def test_each_build_holds_only_its_levels_instructions(level: str) -> None:
    if level not in ISAS:
        pytest.skip(f"this CPU executes no {level} build")
    if shutil.which("objdump") is None:
        pytest.skip("no objdump")
    library = library_at(level)
    code = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", library._name],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "paged_decode_bf16" in code and "mxfp4_matmul_f32" in code and "lora_update" in code
    assert "mxfp4_matmul_a8_f32" in code and "int6_matmul_a8_bf16" in code
    for register in FORBIDDEN[level]:
        assert f"%{register}" not in code, register
    if level == "avx2":
        assert "%ymm" in code  # vectorised at all

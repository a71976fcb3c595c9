"""Builds the C kernels beside this file (paged attention, RMSNorm, int4 matmuls with bf16
or int8 activations, the 5-, 6- and 8-bit matmuls, MXFP4 ones with fp32 or int8
activations and the 6-bit grid finder, the decoder layer around attention with its LoRA
update (and a stack of them), a mixture of experts' experts, greedy argmax, a GGUF
embedding's rows) into one shared library for this machine, once, and loads it with ctypes.

C rather than a PyTorch extension: plain C with no PyTorch headers compiles in about a
second with the system's compiler, so the library is simply built where it runs, with
`-march=native`, and cached by source, compiler flags and CPU. A machine without a C
compiler gets `NativeUnavailable` saying so, and the caller falls back to plain PyTorch.

`LLAMASERVE_CPU_ISA` builds for a lower instruction level than the machine's: `avx512`
(x86-64-v4: AVX-512 without its BF16 and VNNI extensions), `avx2` (x86-64-v3, the
AVX2-only EPYCs) or `portable` (baseline x86-64). The kernels take other loops at each
level, so the tests run them at every level the machine can execute (`executable_isas`),
and a developer on an AVX-512 machine sees what an AVX2 one runs. It is read where the
library is chosen, like `CC`: a build setting, not a serving one.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from functools import cache
from pathlib import Path

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = (
    "paged_decode.c",
    "paged_decode_int8.c",
    "rms_norm.c",
    "int4_matmul.c",
    "int4_pack.c",
    "int4_matmul_a8.c",
    "int4k_matmul.c",
    "int4k_matmul_a8.c",
    "int5_matmul.c",
    "int5_matmul_a8.c",
    "int6_matmul.c",
    "int6_matmul_a8.c",
    "int6_grid.c",
    "int8_matmul.c",
    "int8_matmul_a8.c",
    "decoder_layer.c",
    "decoder_stack.c",
    "lora_update.c",
    "moe_experts.c",
    "moe_router.c",
    "topk_select.c",
    "mxfp4_matmul.c",
    "mxfp4_matmul_a8.c",
    "argmax.c",
    "gguf_rows.c",
)
HEADERS = (
    "bf16.h",
    "tiles.h",
    "int4_portable.h",
    "portable_group.h",
    "paged_pairs_avx512.h",
    "paged_pairs_avx2.h",
    "paged_int8_avx512.h",
    "paged_int8_avx2.h",
    "paged_int8_columns.h",
    "int5_avx512.h",
    "int6_avx512.h",
    "int8_rows.h",
    "layer_weight.h",
    "lora_step.h",
    "mxfp4_block.h",
    "moe_layer.h",
    "mxfp4_dpbf16.h",
    "int4_one_row.h",
    "int4_scales.h",
    "topk_select.h",
)
# Fast math lets the compiler vectorise the dot products, sums and exponentials (glibc's
# vector expf); the order of operations is then fixed in the binary, the same for every
# call. It is for compiling only: linked with it, gcc before 13 adds a constructor that
# turns on flush-to-zero for the whole process, PyTorch's arithmetic included. OpenMP: the
# library needs `libgomp.so.1`, which the dynamic loader finds already loaded (PyTorch's
# CPU wheels ship it under that name), so the kernel shares PyTorch's threads rather than
# starting its own.
COMPILE_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-ffast-math")
LINK_FLAGS = ("-shared", "-fopenmp")
BUILD_TIMEOUT_S = 120

ISA_ENV = "LLAMASERVE_CPU_ISA"
# The instruction level of each build: `-march` for the compiler, and the CPU flags a
# machine needs to execute it (x86-64-v3 is AVX2, FMA, F16C, BMI1/2, LZCNT and MOVBE).
ISA_MARCH = {"native": "native", "avx512": "x86-64-v4", "avx2": "x86-64-v3", "portable": "x86-64"}
_AVX2_FLAGS = frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"})
_ISA_CPU_FLAGS = {
    "native": frozenset(),
    "avx512": _AVX2_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
    "avx2": _AVX2_FLAGS,
    "portable": frozenset(),
}


class NativeUnavailable(RuntimeError):
    """The kernels cannot be built or loaded here; the message says why."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "llamaserve" / "native"


def executable_isas() -> tuple[str, ...]:
    """The levels this machine can execute: its own, and on x86-64 the lower ones its
    flags cover."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ("native",)
    flags = cpu_flags()
    return tuple(isa for isa, needs in _ISA_CPU_FLAGS.items() if needs <= flags)


def isa() -> str:
    """The level `load_library` builds for: LLAMASERVE_CPU_ISA, else the machine's own."""
    level = os.environ.get(ISA_ENV) or "native"
    if level not in ISA_MARCH:
        raise NativeUnavailable(f"{ISA_ENV}={level!r}: choose one of {', '.join(ISA_MARCH)}")
    if level not in executable_isas():
        raise NativeUnavailable(f"{ISA_ENV}={level}: this CPU cannot execute that level")
    return level


def load_library() -> ctypes.CDLL:
    """The library for the chosen level (`isa`), built first when this machine has none
    yet."""
    return library_for(isa())


@cache
def library_for(level: str) -> ctypes.CDLL:
    """The library built for `level`, one of `executable_isas()`."""
    if platform.system() != "Linux":
        raise NativeUnavailable(f"native kernels are built on Linux only, not {platform.system()}")
    compiler = _compiler()
    compile_flags = (f"-march={ISA_MARCH[level]}", *COMPILE_FLAGS)
    target = cache_dir() / f"kernels-{level}-{library_key(level)[:16]}.so"
    if not target.exists():
        _build(compiler, compile_flags, target)
    try:
        library = ctypes.CDLL(str(target))
    except OSError as exc:
        raise NativeUnavailable(f"cannot load {target}: {exc}") from None
    logger.info("C kernels: the %s build (-march=%s), %s", level, ISA_MARCH[level], target)
    return library


@cache
def library_key(level: str) -> str:
    """What the library for `level` is built from: sources, compiler and flags, and the
    CPU (what `-march=native` depends on); its file name, and the key of anything
    measured on it (model/plan/tuning.py)."""
    compiler = _compiler()
    compile_flags = (f"-march={ISA_MARCH[level]}", *COMPILE_FLAGS)
    text = b"".join((HERE / name).read_bytes() for name in (*SOURCES, *HEADERS))
    flags = " ".join((compiler, *compile_flags, *LINK_FLAGS)).encode()
    return hashlib.sha256(text + flags + cpu_id()).hexdigest()


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise NativeUnavailable("no C compiler (cc or gcc) on PATH")
    return compiler


def _build(compiler: str, compile_flags: tuple[str, ...], target: Path) -> None:
    started = time.perf_counter()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Built under a temporary name and renamed: a concurrent start-up never loads half
        # a file.
        fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as exc:
        raise NativeUnavailable(
            f"cannot write to {target.parent} ({exc.strerror}); XDG_CACHE_HOME chooses another"
        ) from None
    objects = [f"{partial}.{Path(name).stem}.o" for name in SOURCES]
    compiles = [
        [compiler, *compile_flags, "-c", "-o", obj, str(HERE / name)]
        for name, obj in zip(SOURCES, objects, strict=True)
    ]
    try:
        _run_all(compiles, len(os.sched_getaffinity(0)))  # the cores this process may use
        _run_all([[compiler, *LINK_FLAGS, "-o", partial, *objects, "-lm"]], 1)
        os.replace(partial, target)
    except OSError as exc:
        raise NativeUnavailable(f"cannot build {target.name}: {exc}") from None
    finally:
        for path in (partial, *objects):
            Path(path).unlink(missing_ok=True)
    logger.info("built %s in %.1f s", target, time.perf_counter() - started)


def _run_all(commands: list[list[str]], at_once: int) -> None:
    """Runs `commands`, up to `at_once` side by side: the sources compile independently,
    and one at a time a first build on two cores took 11.6 s instead of 8.1."""
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    waiting, running = list(commands), []
    try:
        while waiting or running:
            while waiting and len(running) < at_once:
                command = waiting.pop(0)
                process = subprocess.Popen(
                    command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
                )
                running.append((command, process))
            command, process = running.pop(0)
            try:
                _, stderr = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                running.append((command, process))  # killed below
                raise NativeUnavailable(
                    f"{' '.join(command)} took over {BUILD_TIMEOUT_S} s"
                ) from None
            if process.returncode != 0:
                raise NativeUnavailable(f"{' '.join(command)} failed: {stderr.strip()[:500]}")
    finally:
        for _, process in running:
            process.kill()
            process.wait()


def cpu_id() -> bytes:
    """What `-march=native` depends on: a library built on one CPU must not be loaded on
    another that shares the cache directory."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine().encode()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted).encode()


def cpu_flags() -> frozenset[str]:
    for line in cpu_id().decode().splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()

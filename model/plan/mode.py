"""`--cpu-kernels`: how the kernel plan chooses. `auto` (the default) times what depends
on the CPU (remembered by model/plan/tuning.py) and takes the C kernels where they win;
`native` takes the C kernels wherever they apply, untimed, and is one sentence where they
cannot be built; `torch` keeps every op in plain PyTorch, the reference the kernels are
tested against. The mode is a value handed to each choice, never a process global."""

from __future__ import annotations

from model.errors import UnsupportedFormatError
from model.native.build import NativeUnavailable
from model.native.ops import native_int4_matmul

CPU_KERNELS = ("auto", "native", "torch")
# What runs on the C kernels alone: no PyTorch twin serves these formats.
NATIVE_ONLY_QUANTIZATIONS = ("w4a8", "int8g")


def check_mode(mode: str) -> str:
    """The mode, once it is known to be one and, for `native`, that the C kernels build."""
    if mode not in CPU_KERNELS:
        raise UnsupportedFormatError(
            f"--cpu-kernels {mode!r}: choose one of {', '.join(CPU_KERNELS)}"
        )
    if mode == "native":
        _native_or_refuse("--cpu-kernels native")
    return mode


def check_quantization(mode: str, quantization: str | None) -> None:
    """One sentence for a format only the C kernels run, where the mode keeps them off."""
    if mode == "torch" and quantization in NATIVE_ONLY_QUANTIZATIONS:
        raise UnsupportedFormatError(
            f"--quantization {quantization} runs on the C kernels; --cpu-kernels torch keeps "
            "them off"
        )


def allows_native(mode: str) -> bool:
    return mode != "torch"


def _native_or_refuse(what: str) -> None:
    try:
        native_int4_matmul("native")
    except NativeUnavailable as exc:
        raise UnsupportedFormatError(f"{what}: the C kernels are unavailable: {exc}") from None

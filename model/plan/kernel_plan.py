"""The CPU kernel plan: which kernels a forward runs, decided once when a model is loaded
(model/plan/build.py) and logged in one line when the engine starts.

Its parts: the instruction level the C kernels are built for (`LLAMASERVE_CPU_ISA`,
model/native/build.py); the weight format and the layers that run in their own; per int4
layer shape, our C kernel (bf16 or int8 activations) or PyTorch's; the output projection
in grouped int8 (or int6) or the model's dtype; the attention backend, and with the C
attention the C RMSNorm and decoder layers (one library: all of them or none, so that the
C path and the PyTorch reference each stay whole); the C argmax. The runner adds the
threads for one-token steps and the step's token budget to the log line (`describe`).

The plan is a value: the model keeps it (`Llama.kernel_plan`), the runner reads the argmax
from it, and a draft model is loaded under its target's mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import torch

from model.attention import attention_backend
from model.errors import UnsupportedFormatError
from model.native.build import NativeUnavailable, isa
from model.native.ops import NativeArgmax, NativeRmsNorm
from model.plan.layer_formats import describe as describe_formats
from model.plan.weight_format import WeightFormat

Int4Kernels = dict[tuple[str, int, int], str]  # (int4, w4a8 or mxfp4, in, out) -> kernel


@dataclass(frozen=True)
class KernelPlan:
    mode: str  # --cpu-kernels: auto, native or torch (model/plan/mode.py)
    device: str
    weight_format: WeightFormat
    n_linears: int  # the decoder's linear layers, each expert's counted
    # The decoder linear layers ('layers.3.down_proj') whose format is not the model's.
    layer_quantizations: dict[str, str] = field(default_factory=dict)
    head: str | None = (
        None  # the output projection's format: int8, int6, w6a8, w8a8, or None (dtype)
    )
    int4_kernels: Int4Kernels = field(default_factory=dict)
    attention: str = "torch_ref"  # the backend `--attention-backend` resolved to
    argmax: bool = False  # the C argmax over CPU rows

    def formats(self) -> str:
        """The weight format with its layers' mix and the output projection's, for the
        loader's log line: 'bfloat16 + int4 (output projection int8)'."""
        line = describe_formats(self.weight_format, self.layer_quantizations, self.n_linears)
        return line + (f" (output projection {self.head})" if self.head else "")

    def argmax_kernel(self) -> NativeArgmax | None:
        """The C argmax over CPU rows, or None: PyTorch's."""
        return _native_argmax() if self.argmax else None

    def describe(self, model: torch.nn.Module, small_step_threads: int, token_budget: int) -> str:
        """The plan in one line, with what only the loaded model (how many decoder layers
        run in C) and the runner know."""
        try:
            level = isa() if self.mode != "torch" else "unused"
        except NativeUnavailable as exc:
            level = f"unavailable ({exc})"
        int4 = sorted({k for (fmt, *_), k in self.int4_kernels.items() if fmt != "mxfp4"})
        head = self.head or str(self.weight_format.dtype)
        c_layers = sum(getattr(layer, "native", None) is not None for layer in model.layers)
        return "; ".join(
            [
                f"--cpu-kernels {self.mode}",
                f"C kernels {level}",
                f"attention {self.attention}",
                f"C norm and decoder layers in {c_layers} of {len(model.layers)}",
                f"int4 kernels {'/'.join(int4) if int4 else 'none'}",
                f"output projection {head.removeprefix('torch.')}",
                f"argmax {'C' if self.argmax else 'PyTorch'}",
                f"one-token steps on {small_step_threads} thread(s)",
                f"step token budget {token_budget}",
            ]
        )


def attention_name(mode: str, name: str, device: torch.device | str) -> str:
    """The attention backend `--attention-backend` names, `auto` resolved under `mode`."""
    device = torch.device(device)
    if device.type == "cpu" and mode == "torch":
        if name == "cpu_paged":
            raise UnsupportedFormatError(
                "--attention-backend cpu_paged is a C kernel; --cpu-kernels torch keeps them off"
            )
        name = "torch_ref" if name == "auto" else name
    elif device.type == "cpu" and mode == "native" and name == "auto":
        name = "cpu_paged"
    try:
        return attention_backend(name, device).name
    except ValueError as exc:
        raise UnsupportedFormatError(str(exc)) from None


def use_kernels(model: torch.nn.Module, plan: KernelPlan) -> None:
    """The plan's attention backend, and with the CPU's C attention the C RMSNorm and
    decoder layers too: all come from one library. With the Triton attention on a GPU,
    RMSNorm and RoPE in one Triton kernel each (model/cuda_ops.py)."""
    model.kernel_plan = plan
    model.attention = attention_backend(plan.attention, plan.device)
    if model.attention.name == "cpu_paged":
        model.use_native_norm(NativeRmsNorm())
        model.use_native_layers()
    elif model.attention.name == "triton_paged" and torch.device(plan.device).type == "cuda":
        from model.cuda_ops import TritonRmsNorm, triton_rope

        model.use_native_norm(TritonRmsNorm())
        model.use_rope_kernel(triton_rope)


def native_argmax_available() -> bool:
    return _native_argmax() is not None


@cache
def _native_argmax() -> NativeArgmax | None:
    try:
        return NativeArgmax()
    except NativeUnavailable:
        return None

"""Attention backends behind one interface (`base.AttentionBackend`), chosen by name or,
with "auto", by device: Triton's paged kernels on CUDA; on the CPU, the C decode kernel
where a C compiler can build it, else the plain-PyTorch reference."""

from __future__ import annotations

import importlib.util
import logging

import torch

from model.attention.base import AttentionBackend
from model.attention.cpu_paged import CpuPagedBackend
from model.attention.kernels import interpreting
from model.attention.torch_ref import TorchRefBackend
from model.native.build import NativeUnavailable

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "torch_ref", "cpu_paged", "triton_paged")


def attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """One sentence (ValueError) when the backend cannot run here."""
    device = torch.device(device)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    has_triton = importlib.util.find_spec("triton") is not None
    if name == "auto" and device.type == "cpu":
        try:
            return CpuPagedBackend()
        except NativeUnavailable as exc:
            logger.warning("attention: the plain-PyTorch reference, slower: %s", exc)
            return TorchRefBackend()
    if name == "auto":
        name = "triton_paged" if device.type == "cuda" and has_triton else "torch_ref"
    if name == "torch_ref":
        return TorchRefBackend()
    if name == "cpu_paged":
        if device.type != "cpu":
            raise ValueError("the cpu_paged attention backend runs on the CPU only")
        try:
            return CpuPagedBackend()
        except NativeUnavailable as exc:
            raise ValueError(f"the cpu_paged attention backend is unavailable: {exc}") from None
    if not has_triton:
        raise ValueError("the triton_paged attention backend needs the triton package")
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            "the triton_paged attention backend runs on CUDA devices, or on the CPU only "
            "under Triton's interpreter (TRITON_INTERPRET=1)"
        )
    from model.attention.triton_paged import TritonPagedBackend

    return TritonPagedBackend()

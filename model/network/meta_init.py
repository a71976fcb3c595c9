"""A model's skeleton on the meta device, without its random initialisation, and its
tensors made real.

`Llama.empty` fills every weight from the checkpoint, so the init's fills are wasted; on
meta tensors PyTorch also runs them through Python decompositions whose first use imports
torch._dynamo, which nothing else in the server loads: 1.6 s of a 6 s start on a 2-core
EPYC, before any weight is read. `Module.to_empty`'s `empty_like` of a meta tensor goes the
same way and imports sympy (0.45 s)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

# nn.init's random fills and the tensor methods they end in.
_FILLS = frozenset(
    {"normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_"}
    | {"xavier_uniform_", "xavier_normal_"}
)


class _SkippedFills(TorchFunctionMode):
    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _FILLS:
            # The tensor it would have filled, left as it is (nn.init passes it by name).
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


@contextmanager
def skeleton() -> Iterator[None]:
    """Modules built inside have meta tensors that nothing has filled."""
    with torch.device("meta"), _SkippedFills():
        yield


def materialise(module: nn.Module, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """The skeleton's tensors as uninitialised ones on `device`, its floating-point ones in
    `dtype` (what `.to(dtype).to_empty(device=device)` gives)."""

    def real(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(
            t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device
        )

    return module._apply(real)

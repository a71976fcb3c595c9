"""Every decoder layer of a step of decodes in one C call (decoder_stack.c), for a model whose
layers all run whole in C (model/native/layer.py) with a dense MLP: the same calls of
decoder_layer_decode, in the same order, as the layer loop makes, without the ~6 us of
Python around each (28-30 layers: about 0.2 ms a one-stream step).
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence

import torch

from model.native.build import load_library
from model.native.layer import (
    DecodeBatch,
    NativeDecoderLayer,
    cache_fits,
    decode_output,
    takes_inputs,
)
from model.network.paged_cache import PagedKVCache

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class _StackLayer(ctypes.Structure):
    """decoder_stack.c's `stack_layer`: same fields, same order."""

    _fields_ = [
        ("layer", _PTR),
        ("k_cache", _PTR),
        ("v_cache", _PTR),
        ("scale", ctypes.c_float),
        ("window", _I64),
        ("local", _I64),
    ]


class NativeLayerStack:
    """`layers` the C layers in order, `scales` and `windows` (None: the whole context) each
    layer's; the caches' pointers are filled for the cache a step runs on."""

    def __init__(
        self, layers: list[NativeDecoderLayer], scales: list[float], windows: list[int | None]
    ) -> None:
        self._kernel = load_library().decoder_stack_decode
        self._kernel.argtypes = [_PTR, _I64, _PTR, _I64, _I64, *[_PTR] * 6, _I64, _PTR, _I64, _I64]
        self._kernel.argtypes += [_PTR]
        self._kernel.restype = ctypes.c_int
        self.layers = layers
        self._sinks = any(layer.has_sinks for layer in layers)
        self._table = (_StackLayer * len(layers))()
        for entry, layer, scale, window in zip(self._table, layers, scales, windows, strict=True):
            entry.layer, entry.scale = layer.pointer, scale
            entry.window, entry.local = window or 0, window is not None
        self._pointer = ctypes.addressof(self._table)
        # The cache whose pointers the table holds; weakly, so as not to keep it alive.
        self._cache: weakref.ref[PagedKVCache] | None = None
        self.dim = layers[0].dim

    @classmethod
    def for_layers(
        cls, layers: Sequence[torch.nn.Module], windows: list[int | None]
    ) -> NativeLayerStack | None:
        """The stack of decoder layers (model/network/decoder_layer.py) where every one
        runs whole in C with a dense MLP; None where one does not."""
        natives = [getattr(layer, "native", None) for layer in layers]
        if not natives or any(
            native is None or layer.moe is not None
            for layer, native in zip(layers, natives, strict=True)
        ):
            return None
        return cls(natives, [layer.scale for layer in layers], windows)

    def decode(
        self,
        modules: Sequence[torch.nn.Module],
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        local_rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: PagedKVCache,
        decodes: DecodeBatch,
    ) -> torch.Tensor | None:
        """The last layer's output for h [rows, dim] (`local_rope` the windowed layers'
        angles); None where a layer of `modules` no longer holds the C layer it had, or
        the inputs or the cache do not fit it: the caller then runs the layers one by one."""
        k_cache, v_cache = kv_cache.layers[0]
        if not (
            takes_inputs(h, rope[0])
            and cache_fits(k_cache, v_cache, self._sinks)
            and all(m.native is n for m, n in zip(modules, self.layers, strict=True))
        ):
            return None
        if self._cache is None or self._cache() is not kv_cache:
            for entry, (k, v) in zip(self._table, kv_cache.layers, strict=True):
                entry.k_cache, entry.v_cache = k.data_ptr(), v.data_ptr()
            self._cache = weakref.ref(kv_cache)
        rows = h.shape[0]
        out = torch.empty_like(h)
        status = self._kernel(
            self._pointer,
            len(self.layers),
            h.data_ptr(),
            rows,
            self.dim,
            rope[0].data_ptr(),
            rope[1].data_ptr(),
            local_rope[0].data_ptr(),
            local_rope[1].data_ptr(),
            *decodes.arguments,
            k_cache.shape[1],
            k_cache.dtype == torch.int8,
            out.data_ptr(),
        )
        return decode_output(status, out)

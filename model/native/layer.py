"""A decoder layer's work around attention in two C calls (decoder_layer.c), for bf16
models whose linear layers all run on the C kernels (int4 with bf16 or int8 activations,
int5, int6 or grouped int8, per projection), with each family's additions: Qwen2's Q/K/V
bias, the per-head Q/K norms of Qwen3 and Gemma 3, Gemma 3's norms after attention and the MLP and
its GELU-tanh gate, gpt-oss's O bias and attention sinks; with LoRA adapters resident, the
update of each adapter row after every projection (`use_lora`, model/native/lora.py). A
layer whose MLP is a mixture of experts runs its router and experts after attention's
residual add, in the same call, where `use_moe` gave it them (else its caller runs them:
model/network/moe.py).

At one stream on 2 cores the PyTorch layer's ~40 small ops (splits, views, RoPE's halves,
casts, SiLU, adds) cost more in dispatch than its arithmetic. Attention itself stays with
the attention backend, between the two calls, as do the cache writes; except in a step of
decodes only on the C attention, whose plan carries a `DecodeBatch`: there the whole layer,
cache writes and attention included, is one call (another 50-80 µs of Python per layer at
one stream).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from model.native.build import load_library
from model.native.layer_weight import NativeWeight, WeightStruct
from model.native.lora import NativeLoraStep

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@dataclass
class DecodeBatch:
    """A step whose rows are all decodes, as `decode` reads it: the attention backend's
    plan carries one (model/attention/cpu_paged.py)."""

    slots: torch.Tensor  # [rows] int64: the cache slot of each row's new K/V
    block_tables: torch.Tensor  # [rows, blocks] int64, rows contiguous
    seq_lens: torch.Tensor  # [rows] int64, the new token included

    def __post_init__(self) -> None:
        # What every layer's call reads of them, found once a step rather than per layer.
        tables = self.block_tables
        self.arguments = (
            self.slots.data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            self.seq_lens.data_ptr(),
        )


def takes_inputs(h: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether the C layer reads these activations and angles: h contiguous bf16, the
    angles fp32."""
    return h.dtype == torch.bfloat16 and h.is_contiguous() and cos.dtype == torch.float32


def cache_fits(k_cache: torch.Tensor, v_cache: torch.Tensor, sinks: bool) -> bool:
    """Whether the C layer's decode writes and reads this cache: bf16, or int8
    (model/network/kv_int8.py) by a kernel without attention sinks; contiguous."""
    int8 = k_cache.dtype == torch.int8
    return (
        k_cache.dtype == v_cache.dtype
        and (k_cache.dtype == torch.bfloat16 or (int8 and not sinks))
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


def decode_output(status: int, out: torch.Tensor) -> torch.Tensor | None:
    """A C decode's output by its status: None for 1 (shapes past the attention kernel's
    buffers, found before anything is written: the caller runs the layers itself)."""
    if status == 1:
        return None
    if status:
        raise MemoryError("decoder layer: out of memory for its buffers")
    return out


class _DecoderLayer(ctypes.Structure):
    """decoder_layer.c's `decoder_layer`: same fields, same order."""

    _fields_ = [
        ("input_norm", _PTR),
        ("post_attention_norm", _PTR),
        ("qkv", WeightStruct),
        ("o", WeightStruct),
        ("gate_up", WeightStruct),
        ("down", WeightStruct),
        ("qkv_bias", _PTR),
        ("q_norm", _PTR),
        ("k_norm", _PTR),
        ("attn_out_norm", _PTR),
        ("ffn_out_norm", _PTR),
        ("gelu", _I64),
        ("dim", _I64),
        ("n_heads", _I64),
        ("n_kv", _I64),
        ("head_dim", _I64),
        ("ffn", _I64),
        ("eps", ctypes.c_float),
        ("o_bias", _PTR),
        ("sinks", _PTR),
        ("lora_a", _PTR * 4),
        ("lora_bt", _PTR * 4),
        ("lora_block_offset", _I64 * 4),
        ("lora", _PTR),
        ("moe", _PTR),
    ]


class NativeDecoderLayer:
    """Holds one layer's weight pointers: `layer` is a DecoderLayer with bf16 norms (and
    bias), `projections` its Q/K/V, O, gate/up and down weights (a mixture of experts' layer:
    Q/K/V and O only); the caller checks."""

    def __init__(self, layer: torch.nn.Module, projections: list[NativeWeight]) -> None:
        library = load_library()
        self._input = library.decoder_attention_input
        self._input.argtypes = [_PTR, _PTR, _I64, _PTR, _PTR, _PTR]
        self._input.restype = ctypes.c_int
        self._output = library.decoder_attention_output
        self._output.argtypes = [_PTR, _PTR, _PTR, _I64, _I64, _PTR]
        self._output.restype = ctypes.c_int
        self._decode = library.decoder_layer_decode
        self._decode.argtypes = [_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64]
        self._decode.argtypes += [_PTR, _I64, ctypes.c_float, _I64, _I64, _PTR]
        self._decode.restype = ctypes.c_int
        c = layer.config
        self.q_size, self.kv_size, self.dim = c.q_size, c.kv_size, c.dim
        self.n_heads, self.n_kv, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        # The tensors are referenced here, so the pointers below stay valid.
        self._tensors: list[torch.Tensor] = []
        weights = [WeightStruct(None, None, 0)] * 4
        for i, (weight, scales, kind) in enumerate(projections):
            self._tensors += [weight, scales]
            weights[i] = WeightStruct(weight.data_ptr(), scales.data_ptr(), kind)
        optional = [
            layer.qkv_bias,
            *(
                norm.weight if norm is not None else None
                for norm in (layer.q_norm, layer.k_norm, layer.attn_out_norm, layer.ffn_out_norm)
            ),
        ]
        # gpt-oss: the O bias in bf16 as the PyTorch layer adds it; the sinks in fp32, as
        # the attention kernel's softmax is.
        sinks = layer.sinks.detach().float().contiguous() if layer.sinks is not None else None
        optional_gpt_oss = [layer.o_bias, sinks]
        self.has_sinks = sinks is not None
        self._tensors += [t for t in optional + optional_gpt_oss if t is not None]
        self._struct = _DecoderLayer(
            layer.input_layernorm.weight.data_ptr(),
            layer.post_attention_layernorm.weight.data_ptr(),
            *weights,
            *(t.data_ptr() if t is not None else None for t in optional),
            c.hidden_act != "silu",
            c.dim,
            c.n_heads,
            c.n_kv_heads,
            c.head_dim,
            c.ffn_dim if len(projections) == 4 else 0,  # 0: the experts are the caller's
            layer.input_layernorm.eps,
            layer.o_bias.data_ptr() if layer.o_bias is not None else None,
            sinks.data_ptr() if sinks is not None else None,
        )
        self._tensors += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        self.pointer = ctypes.addressof(self._struct)
        self.lora = False  # whether `use_lora` gave this layer the adapters' stacks
        self.moe: object | None = None  # set by `use_moe`

    def use_moe(self, experts: object | None, pointer: int | None = None) -> None:
        """A mixture of experts' layer runs its norm, router and experts in the same call,
        after attention: `pointer` is model/native/moe.py's struct of them, with a router,
        held by `experts` (None: the caller runs them)."""
        self.moe = experts  # referenced while the struct points into it
        self._struct.moe = pointer if experts is not None else None

    def use_lora(
        self,
        a: list[torch.Tensor],
        bt: list[torch.Tensor],
        block_offsets: list[int],
        step: NativeLoraStep,
    ) -> None:
        """Adds the update of each adapter row after every projection: `a` and `bt` the
        resident slots' A and B^T stacks of Q/K/V, O, gate/up and down
        (model/lora/slots.py's copies, bf16 contiguous), `block_offsets` where the same
        copies lie in each slot's block (`step`'s), `step` the rows every layer reads."""
        assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in a + bt)
        # Referenced while the struct points into them; an earlier table's are let go.
        self._lora_tensors = [*a, *bt]
        self._step = step
        for i, (a_stack, bt_stack) in enumerate(zip(a, bt, strict=True)):
            self._struct.lora_a[i] = a_stack.data_ptr()
            self._struct.lora_bt[i] = bt_stack.data_ptr()
            self._struct.lora_block_offset[i] = block_offsets[i]
        self._struct.lora = step.pointer
        self.lora = True

    def attention_input(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [T, dim] contiguous bf16; cos, sin [T, 1, head_dim / 2] fp32. Returns q, k, v
        [T, heads, head_dim], views of one buffer."""
        rows = h.shape[0]
        qkv = torch.empty(rows, self.q_size + 2 * self.kv_size, dtype=torch.bfloat16)
        status = self._input(
            self.pointer, h.data_ptr(), rows, cos.data_ptr(), sin.data_ptr(), qkv.data_ptr()
        )
        if status:
            raise MemoryError("decoder layer: out of memory for its buffers")
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=1)
        return (
            q.view(rows, self.n_heads, self.head_dim),
            k.view(rows, self.n_kv, self.head_dim),
            v.view(rows, self.n_kv, self.head_dim),
        )

    def attention_output(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """h [T, dim] contiguous bf16; attn [T, n_heads, head_dim] bf16. The layer's output."""
        rows = h.shape[0]
        flat = attn.reshape(rows, self.q_size)
        if flat.stride(1) != 1:
            flat = flat.contiguous()
        out = torch.empty_like(h)
        status = self._output(
            self.pointer, h.data_ptr(), flat.data_ptr(), flat.stride(0), rows, out.data_ptr()
        )
        if status:
            raise MemoryError("decoder layer: out of memory for its buffers")
        return out

    def decode(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        decodes: DecodeBatch,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor | None:
        """The whole layer for a batch of decodes in one call; None where the cache does
        not fit (another dtype, or a strided view): the caller then runs the layer. An
        int8 cache (model/network/kv_int8.py) is written and read in its own layout, by a
        kernel without attention sinks: a gpt-oss layer over one is the caller's."""
        if not cache_fits(k_cache, v_cache, self.has_sinks):
            return None
        rows = h.shape[0]
        out = torch.empty_like(h)
        status = self._decode(
            self.pointer,
            h.data_ptr(),
            rows,
            cos.data_ptr(),
            sin.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            *decodes.arguments,
            k_cache.shape[1],
            scale,
            window or 0,
            k_cache.dtype == torch.int8,
            out.data_ptr(),
        )
        return decode_output(status, out)

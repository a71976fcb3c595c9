"""Streams the weights of a GGUF file as HF-named tensors in the HF RoPE layout,
dequantised to the compute dtype.

For `llama` files llama.cpp's converter reorders the rows of attn_q/attn_k so that it can
rotate adjacent pairs (2i, 2i+1); we rotate halves (i, i + d/2), so those rows are put
back here. K must be un-permuted with n_kv_heads, not n_heads: with GQA the two differ,
and the mistake gives no error, only wrong text. Families llama.cpp rotates NeoX-style
(Qwen) are stored in HF's order and left as they are.
"""

import re
from collections.abc import Iterator, Mapping
from math import prod

import torch
from gguf import GGMLQuantizationType

from model.checkpoint.dequant import SUPPORTED_TYPES, UnsupportedQuantType, dequantize
from model.checkpoint.file_blocks import FileBlocks
from model.checkpoint.gguf_experts import (
    count_stack_blocks,
    expert_layer_keys,
    is_expert_stack,
    iter_expert_stack,
)
from model.checkpoint.gguf_file import GGUFFile, GGUFTensor
from model.config import ModelConfig
from model.errors import ModelFileError
from model.families import FAMILIES

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "attn_out_norm",  # Gemma 3's norms after attention and the MLP
    "post_ffw_norm": "ffn_out_norm",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
    "attn_sinks": "self_attn.sinks",  # gpt-oss
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors llama.cpp may store that the network does not use.
_IGNORED = {"rope_freqs.weight"}


def hf_name(gguf_name: str, family_names: Mapping[str, str] | None = None) -> str | None:
    """`family_names`: the kinds a family names otherwise (model/families/)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    names = {**_LAYER_NAMES, **(family_names or {})}
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return None


def interleaved_to_halves(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows h*d + 2i + j (interleaved pairs) -> rows h*d + j*d/2 + i (halves)."""
    rows, cols = weight.shape
    head_dim = rows // n_heads
    return weight.view(n_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


# A tensor larger than this in float32 comes in blocks of rows: dequantised whole,
# Qwen2.5-0.5B's 152k-row embedding alone took 545 MB in float32 and as much again in
# temporaries, doubling the server's peak memory at load; and each layer's temporaries,
# several times its float32 size, were what the peak held above the loaded weights (blocks
# of 64 MB: peak 1.12 GB for 0.98 GB loaded; of 4 MB, with the heap trimmed as loading
# goes, model/loader.py: 1.03 GB, in the same time; of 1 MB, with the layers' staging in
# slices of 256 rows: 15 MB less again, in the same time).
ROW_BLOCK_BYTES = 1 << 20


def _block_rows(tensor: GGUFTensor, permuted: bool, undecoded: bool = False) -> int:
    """Rows of 1 MB in float32, or of 1 MB of the file's bytes where they stay undecoded
    (a layer unpacks those in a few small temporaries, and fewer, larger blocks took
    Qwen2.5-Coder-1.5B's load from 5.5 to 5.0 s)."""
    shape = tuple(reversed(tensor.shape))
    if len(shape) == 1 or (permuted and tensor.name.endswith(("attn_q.weight", "attn_k.weight"))):
        return shape[0] if len(shape) > 1 else 1
    row_bytes = tensor.nbytes // shape[0] if undecoded else 4 * prod(shape[1:])
    return max(1, min(shape[0], ROW_BLOCK_BYTES // row_bytes))


def iter_gguf_weights(
    gguf: GGUFFile,
    config: ModelConfig,
    dtype: torch.dtype,
    row_blocks: bool = True,
    skip: frozenset[str] = frozenset(),
    file_blocks: frozenset[GGMLQuantizationType] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor | FileBlocks]]:
    """With `row_blocks`, a large tensor may come as consecutive blocks of its rows, each
    under the tensor's name, in order (`Llama.load_weights` takes them so); Q and K, whose
    rows are reordered per head, always come whole. The GGUF tensors named in `skip` are
    left out; matrices of the block types in `file_blocks` come undecoded, as FileBlocks."""
    family = FAMILIES[config.architecture]
    permuted = family.gguf_permutes_qk
    for tensor in gguf.tensors:
        if tensor.name in _IGNORED or tensor.name in skip:
            continue
        if is_expert_stack(tensor):
            undecoded = tensor.tensor_type in file_blocks
            block_bytes = ROW_BLOCK_BYTES if row_blocks else 1 << 62
            yield from iter_expert_stack(gguf, tensor, dtype, undecoded, block_bytes)
            continue
        name = hf_name(tensor.name, family.gguf_names)
        if name is None:
            raise ModelFileError(f"{gguf.path}: unexpected tensor {tensor.name!r}")
        shape = tuple(reversed(tensor.shape))
        rows = shape[0] if len(shape) > 1 else 1
        undecoded = _undecoded(tensor, file_blocks)
        block = _block_rows(tensor, permuted, undecoded) if row_blocks else rows
        row_bytes = tensor.nbytes // rows
        for first in range(0, rows, block):
            count = min(block, rows - first)
            raw = torch.frombuffer(
                gguf.read(tensor, first * row_bytes, count * row_bytes), dtype=torch.uint8
            )
            part = (count, *shape[1:]) if len(shape) > 1 else shape
            if undecoded:
                weight = raw.view(count, row_bytes)  # Q and K reorder rows of bytes alike
            else:
                try:
                    weight = dequantize(raw, tensor.tensor_type, part, dtype)
                except UnsupportedQuantType as exc:
                    raise ModelFileError(f"{gguf.path}: tensor {tensor.name}: {exc}") from None
            if permuted and tensor.name.endswith("attn_q.weight"):
                weight = interleaved_to_halves(weight, config.n_heads)
            elif permuted and tensor.name.endswith("attn_k.weight"):
                weight = interleaved_to_halves(weight, config.n_kv_heads)
            if undecoded:
                weight = FileBlocks(weight, tensor.tensor_type, shape[1], dtype)
            yield name, weight


def check_tensor_types(gguf: GGUFFile) -> None:
    """Refuses a file with a tensor we cannot dequantise before anything is loaded."""
    for tensor in gguf.tensors:
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise ModelFileError(
                f"{gguf.path}: tensor {tensor.name} has quantisation type "
                f"{tensor.tensor_type.name}, which llamaserve cannot load "
                f"(supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))})"
            )


# Bits per weight of the block types, as far as requantising goes: a 4-bit type (a scale
# and a zero or minimum per group) fits int4 exactly; 5 to 8 bits want int8.
_TYPE_BITS = {
    "Q2_K": 2, "Q3_K": 3, "Q4_0": 4, "Q4_1": 4, "Q4_K": 4,
    "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6, "Q8_0": 8, "MXFP4": 4,
}  # fmt: skip
_LINEAR_SUFFIXES = tuple(
    f"{name}.weight"
    for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    + ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
)


def linear_weight_bits(gguf: GGUFFile) -> int | None:
    """The widest quantised type among the decoder's linear weights, or None when any of
    them is stored as floats: how far weights may be requantised without losing what the
    file holds."""
    bits = [
        _TYPE_BITS.get(t.tensor_type.name)
        for t in gguf.tensors
        if t.name.endswith(_LINEAR_SUFFIXES)
    ]
    if not bits or None in bits:
        return None
    return max(bits)


# The fused linear layer each GGUF matrix loads into (model/network/llama.py).
_FUSED_INTO = {
    "attn_q": "qkv_proj", "attn_k": "qkv_proj", "attn_v": "qkv_proj",
    "attn_output": "o_proj", "ffn_gate": "gate_up_proj", "ffn_up": "gate_up_proj",
    "ffn_down": "down_proj",
}  # fmt: skip


def _linear_types(gguf: GGUFFile) -> dict[str, set[str]]:
    """The block types each of our linear layers ('layers.3.qkv_proj') loads."""
    types: dict[str, set[str]] = {}
    for t in gguf.tensors:
        for key in expert_layer_keys(t):
            types.setdefault(key, set()).add(t.tensor_type.name)
        m = _LAYER_RE.fullmatch(t.name)
        if m and m.group(2) in _FUSED_INTO and m.group(3) == "weight":
            key = f"layers.{m.group(1)}.{_FUSED_INTO[m.group(2)]}"
            types.setdefault(key, set()).add(t.tensor_type.name)
    return types


def wide_linears(gguf: GGUFFile, bits: int = 4) -> frozenset[str]:
    """Our linear layers ('layers.3.down_proj') that load a matrix stored in more than
    `bits` bits: a Q4_K_M file keeps some V and down projections in Q6_K, which int4
    would round, while the rest of its layers fit int4 exactly."""
    return frozenset(
        key
        for key, types in _linear_types(gguf).items()
        if any(_TYPE_BITS.get(name, 16) > bits for name in types)
    )


def split_qkv_linears(gguf: GGUFFile) -> dict[str, tuple[str, str]]:
    """Fused Q/K/V layers ('layers.3.qkv_proj') whose V alone is stored wider than Q and K,
    with (Q and K's block type, V's): a Q4_K_M file keeps Q and K in Q4_K (or Q5_0) and V
    in Q6_K (or Q8_0) in some layers, and the layer then holds Q and K in their own format
    and V in its own (model/quant/split.py) rather than all three in grouped int8. Q and K
    are both 4-bit types or both Q5_0, the types with a format of their own."""
    parts: dict[str, dict[str, str]] = {}
    for t in gguf.tensors:
        m = _LAYER_RE.fullmatch(t.name)
        if m and m.group(2) in ("attn_q", "attn_k", "attn_v") and m.group(3) == "weight":
            key = f"layers.{m.group(1)}.qkv_proj"
            parts.setdefault(key, {})[m.group(2)] = t.tensor_type.name
    split = {}
    for key, types in parts.items():
        q, k, v = (types.get(name) for name in ("attn_q", "attn_k", "attn_v"))
        bits = {_TYPE_BITS.get(q or ""), _TYPE_BITS.get(k or "")}
        same = bits == {4} and "MXFP4" not in (q, k) or q == k == "Q5_0"
        if same and max(bits) < _TYPE_BITS.get(v or "", 16) <= 8:
            split[key] = (q, v)
    return split


def linears_all_in(gguf: GGUFFile, block_type: str) -> frozenset[str]:
    """Our linear layers whose every matrix is stored in `block_type`: Q5_0, which int5
    holds exactly (model/quant/int5.py), or Q6_K, which int6 does (model/quant/int6.py)."""
    return frozenset(key for key, types in _linear_types(gguf).items() if types == {block_type})


def output_quantized(gguf: GGUFFile) -> bool:
    """Whether the output projection's weight (or the embedding it is tied to) is stored in
    a block type of 8 bits or fewer: grouped int8 holds Q8_0 exactly and the narrower
    types (Q6_K, Q5_0, Q4_K) within a sixteenth of their own step, so it keeps what the
    file holds while reading half a bf16 copy's bytes."""
    return output_block_type(gguf) in _TYPE_BITS


def output_block_type(gguf: GGUFFile) -> str | None:
    """The block type of the output projection's weight, or of the embedding it is tied to."""
    types = {t.name: t.tensor_type.name for t in gguf.tensors}
    return types.get("output.weight", types.get("token_embd.weight"))


def count_gguf_tensors(
    gguf: GGUFFile,
    config: ModelConfig,
    row_blocks: bool = True,
    skip: frozenset[str] = frozenset(),
    file_blocks: frozenset[GGMLQuantizationType] = frozenset(),
) -> int:
    """How many tensors, or blocks of rows, `iter_gguf_weights` yields."""
    permuted = FAMILIES[config.architecture].gguf_permutes_qk
    tensors = [t for t in gguf.tensors if t.name not in _IGNORED and t.name not in skip]
    stacks = [t for t in tensors if is_expert_stack(t)]
    tensors = [t for t in tensors if not is_expert_stack(t)]
    block_bytes = ROW_BLOCK_BYTES if row_blocks else 1 << 62
    experts = sum(count_stack_blocks(t, t.tensor_type in file_blocks, block_bytes) for t in stacks)
    if not row_blocks:
        return len(tensors) + experts
    return experts + sum(
        -(
            -(t.shape[-1] if len(t.shape) > 1 else 1)
            // _block_rows(t, permuted, _undecoded(t, file_blocks))
        )
        for t in tensors
    )


def _undecoded(tensor: GGUFTensor, file_blocks: frozenset[GGMLQuantizationType]) -> bool:
    """Whether `iter_gguf_weights` hands the tensor over as FileBlocks: a matrix of those types."""
    return tensor.tensor_type in file_blocks and len(tensor.shape) == 2

"""A GGUF mixture of experts' stacked tensors (`blk.N.ffn_gate_exps`, `ffn_up_exps`,
`ffn_down_exps`: [n_expert, rows, columns], any block type) handed over one expert at a
time under transformers' per-expert names (`mlp.experts.E.gate_proj.weight`), each
expert's rows read from the file in blocks of about 1 MB: no float copy of a whole stack
is ever held, and where a quantised layer holds the block type as it is
(model/checkpoint/file_blocks.py) the rows stay in the file's blocks until that layer
unpacks them into its own format. The router (`ffn_gate_inp`) is an ordinary matrix.
gpt-oss adds a stack of biases to each ([n_expert, rows], `ffn_gate_exps.bias`), handed
over a row per expert."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from model.checkpoint.dequant import dequantize
from model.checkpoint.file_blocks import FileBlocks
from model.checkpoint.gguf_file import GGUFFile, GGUFTensor

_STACK = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)")
# Each stack's per-expert linear layer (model/network/moe.py), gate and up fused.
STACK_FUSED_INTO = {"gate": "gate_up_proj", "up": "gate_up_proj", "down": "down_proj"}


def is_expert_stack(tensor: GGUFTensor) -> bool:
    return _STACK.fullmatch(tensor.name) is not None


def expert_layer_keys(tensor: GGUFTensor) -> list[str]:
    """Our linear layers ('layers.3.moe.experts.5.down_proj') a stack loads into."""
    m = _STACK.fullmatch(tensor.name)
    if m is None or m.group(3) == "bias":
        return []
    ours = STACK_FUSED_INTO[m.group(2)]
    return [f"layers.{m.group(1)}.moe.experts.{e}.{ours}" for e in range(tensor.shape[-1])]


def stack_block_rows(tensor: GGUFTensor, undecoded: bool, block_bytes: int) -> int:
    """Rows of one expert per block: `block_bytes` of float32, or of the file's bytes where
    they stay undecoded."""
    columns, rows, n_experts = tensor.shape
    row_bytes = tensor.nbytes // (n_experts * rows) if undecoded else 4 * columns
    return max(1, min(rows, block_bytes // row_bytes))


def count_stack_blocks(tensor: GGUFTensor, undecoded: bool, block_bytes: int) -> int:
    if len(tensor.shape) == 2:  # biases: one row per expert
        return tensor.shape[1]
    _, rows, n_experts = tensor.shape
    return n_experts * -(-rows // stack_block_rows(tensor, undecoded, block_bytes))


def iter_expert_stack(
    gguf: GGUFFile, tensor: GGUFTensor, dtype: torch.dtype, undecoded: bool, block_bytes: int
) -> Iterator[tuple[str, torch.Tensor | FileBlocks]]:
    """Each expert's rows of the stack, in blocks, under its HF name."""
    m = _STACK.fullmatch(tensor.name)
    assert m is not None
    layer, part = m.group(1), m.group(2)
    if m.group(3) == "bias":
        rows, n_experts = tensor.shape
        raw = torch.frombuffer(gguf.read(tensor, 0, tensor.nbytes), dtype=torch.uint8)
        biases = dequantize(raw, tensor.tensor_type, (n_experts, rows), dtype)
        for expert in range(n_experts):
            yield f"model.layers.{layer}.mlp.experts.{expert}.{part}_proj.bias", biases[expert]
        return
    columns, rows, n_experts = tensor.shape
    row_bytes = tensor.nbytes // (n_experts * rows)
    block = stack_block_rows(tensor, undecoded, block_bytes)
    for expert in range(n_experts):
        name = f"model.layers.{layer}.mlp.experts.{expert}.{part}_proj.weight"
        for first in range(0, rows, block):
            count = min(block, rows - first)
            start = (expert * rows + first) * row_bytes
            raw = torch.frombuffer(gguf.read(tensor, start, count * row_bytes), dtype=torch.uint8)
            qtype = tensor.tensor_type
            if undecoded:
                yield name, FileBlocks(raw.view(count, row_bytes), qtype, columns, dtype)
            else:
                yield name, dequantize(raw, qtype, (count, columns), dtype)

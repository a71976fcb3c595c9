"""Reads a GGUF LoRA file, as llama.cpp's convert_lora_to_gguf.py writes it, into a
`LoraAdapter`.

Such a file says `general.type` = adapter and `adapter.type` = lora, names its base's
architecture, holds one `adapter.lora.alpha`, and stores `blk.N.<tensor>.weight.lora_a`
([rank, in] in torch order) and `.lora_b` ([out, rank]); the scale is alpha / rank, as
llama.cpp applies it. For families whose GGUF files store Q/K rows as interleaved pairs
(Trap 1), B's Q/K rows are too, and are put back into the halves layout the model runs.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from model.checkpoint.dequant import UnsupportedQuantType, dequantize
from model.checkpoint.gguf_file import open_gguf
from model.checkpoint.gguf_weights import interleaved_to_halves
from model.config import ModelConfig
from model.errors import ModelFileError
from model.families import FAMILIES
from model.lora.adapter import AdapterError, LoraAdapter

_NAMES = {
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}
_KEY = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")


def read_gguf_lora(name: str, path: Path, config: ModelConfig) -> LoraAdapter:
    where = f"LoRA adapter {name!r} ({path})"
    try:
        gguf = open_gguf(path)
    except (ModelFileError, OSError, ValueError) as exc:
        raise AdapterError(f"{where} is not a readable GGUF file: {exc}") from None
    md = gguf.metadata
    if md.get("general.type") != "adapter" or md.get("adapter.type", "lora") != "lora":
        raise AdapterError(f"{where} is a GGUF file but not a LoRA adapter (general.type)")
    if gguf.architecture != config.architecture:
        raise AdapterError(
            f"{where} was made for a {gguf.architecture or 'unnamed'} model, the base is "
            f"{config.architecture}"
        )
    if "adapter.lora.alpha" not in md:
        raise AdapterError(f"{where} has no adapter.lora.alpha")
    alpha = float(md["adapter.lora.alpha"])
    permuted = FAMILIES[config.architecture].gguf_permutes_qk
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor in gguf.tensors:
        match = _KEY.match(tensor.name)
        if match is None or match.group(2) not in _NAMES:
            raise AdapterError(
                f"{where}: tensor {tensor.name} adapts a module this server cannot adapt"
            )
        raw = torch.frombuffer(gguf.read(tensor), dtype=torch.uint8)
        try:
            weight = dequantize(raw, tensor.tensor_type, tuple(reversed(tensor.shape)))
        except UnsupportedQuantType as exc:
            raise AdapterError(f"{where}: tensor {tensor.name}: {exc}") from None
        key = (int(match.group(1)), _NAMES[match.group(2)])
        pairs.setdefault(key, {})[match.group(3)] = weight.float()
    weights = {}
    for (layer, target), pair in pairs.items():
        if set(pair) != {"a", "b"}:
            raise AdapterError(f"{where}: layer {layer} {target} lacks its lora_a or lora_b")
        a, b = pair["a"], pair["b"]
        if permuted and target in ("q_proj", "k_proj") and b.shape[0] % 2 == 0:
            heads = config.n_heads if target == "q_proj" else config.n_kv_heads
            if b.shape[0] == heads * config.head_dim:
                b = interleaved_to_halves(b, heads)
        weights[(layer, target)] = (a.contiguous(), (b * (alpha / a.shape[0])).contiguous())
    return LoraAdapter(name, path, weights)

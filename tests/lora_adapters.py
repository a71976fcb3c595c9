"""PEFT adapters on tiny random checkpoints, made by `peft` itself (`get_peft_model` with
random non-zero A and B on all seven projections), and the same adapters written as GGUF
LoRA files with the `gguf` package under llama.cpp's names and layout: the independent
references for the LoRA tests. Nothing here is produced by llamaserve's own code."""

import math
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from peft import LoraConfig, get_peft_model

from tests.tiny_families import _interleave

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def make_adapter(
    base: torch.nn.Module,
    directory: Path,
    rank: int = 8,
    rslora: bool = False,
    seed: int = 0,
    rank_pattern: dict | None = None,
) -> torch.nn.Module:
    """A PEFT model over `base` (changed in place: PEFT wraps it) with random A and B;
    saved to `directory`."""
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=TARGETS,
        use_rslora=rslora,
        init_lora_weights=False,
        rank_pattern=rank_pattern or {},
    )
    peft_model = get_peft_model(base, config).eval()
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)
    peft_model.save_pretrained(directory)
    return peft_model


def write_gguf_lora(
    peft_model: torch.nn.Module, path: Path, architecture: str, n_heads: int, n_kv_heads: int
) -> None:
    """The adapter as llama.cpp's convert_lora_to_gguf.py writes it: `general.type`
    adapter, one `adapter.lora.alpha` (scale = alpha / rank, so an rsLoRA adapter's alpha
    is multiplied by sqrt(rank)), `blk.N.<name>.weight.lora_a|lora_b`, and for llama the
    Q/K rows of B permuted into interleaved pairs as the base's Q/K are."""
    config = peft_model.peft_config["default"]
    alpha = config.lora_alpha * (math.sqrt(config.r) if config.use_rslora else 1.0)
    writer = GGUFWriter(str(path), architecture)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for name, p in peft_model.named_parameters():
        if "lora_" not in name:
            continue
        layer = int(name.split("layers.")[1].split(".")[0])
        module = next(k for k in _GGUF if f".{k}." in name)
        w = p.detach().float().numpy()
        if "lora_B" in name and architecture == "llama" and module.endswith(("q_proj", "k_proj")):
            heads = n_heads if module.endswith("q_proj") else n_kv_heads
            w = _interleave(w, heads)
        kind = "lora_a" if "lora_A" in name else "lora_b"
        writer.add_tensor(
            f"blk.{layer}.{_GGUF[module]}.weight.{kind}",
            np.ascontiguousarray(w),
            raw_dtype=GGMLQuantizationType.F32,
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

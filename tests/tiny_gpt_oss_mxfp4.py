"""The tiny gpt-oss checkpoint (tests/tiny_gpt_oss.py) as OpenAI ships gpt-oss: its experts
in MXFP4, `*_blocks` [experts, out, in / 32, 16] and `*_scales` [experts, out, in / 32]
beside float tensors, and config.json's `quantization_config` {"quant_method": "mxfp4"}.
The blocks are the `gguf` package's quantisation of each expert's weight, repacked into
HF's nibble order (byte j: element 2j low, 2j + 1 high), so that transformers' own MXFP4
code, not ours, decides what they mean."""

import json
import shutil
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize
from safetensors.torch import save_file

_STACKS = ("experts.gate_up_proj", "experts.down_proj")


def hf_mxfp4_pair(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[experts, out, in] floats -> HF `*_blocks` and `*_scales` (uint8)."""
    raw = torch.from_numpy(quantize(weight.float().numpy(), T.MXFP4))
    raw = raw.reshape(*weight.shape[:-1], -1, 17)  # GGUF: scale, then j low / j + 16 high
    nibbles = raw[..., 1:]
    values = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)  # elements 0..31 in order
    blocks = values[..., 0::2] | (values[..., 1::2] << 4)
    return blocks.contiguous(), raw[..., 0].contiguous()


def write_mxfp4_checkpoint(hf: torch.nn.Module, float_dir: Path, directory: Path) -> Path:
    """`hf`'s weights with its experts (transformers' `x @ W` stacks, [experts, in, out])
    stored as MXFP4 pairs of a linear layer's rows; the other files as in `float_dir`."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, value in hf.state_dict().items():
        if name.endswith(_STACKS):
            blocks, scales = hf_mxfp4_pair(value.transpose(1, 2))
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        else:
            tensors[name] = value.contiguous()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (directory / "config.json").write_text(json.dumps(config))
    for file in float_dir.iterdir():
        if file.name not in ("config.json", "model.safetensors"):
            shutil.copy(file, directory / file.name)
    return directory

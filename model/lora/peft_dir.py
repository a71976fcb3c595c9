"""Reads a PEFT LoRA directory (`adapter_config.json` + `adapter_model.safetensors`, as
`get_peft_model(...).save_pretrained` writes it) into a `LoraAdapter`.

The scaling is PEFT's: `lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`,
where r is each module's own rank (its A's rows, which `rank_pattern` sets) and alpha
its own (`alpha_pattern`). What PEFT can express and this server cannot run (DoRA,
adapted embeddings or output head, trained biases, fully trained `modules_to_save`)
is refused in one sentence, never silently dropped.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from model.lora.adapter import ATTENTION_TARGETS, TARGETS, AdapterError, LoraAdapter

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def read_peft_dir(name: str, path: Path) -> LoraAdapter:
    where = f"LoRA adapter {name!r} ({path})"
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{where}: cannot read {CONFIG_FILE}: {exc}") from None
    _check_config(config, where)
    if not (path / WEIGHTS_FILE).is_file():
        raise AdapterError(f"{where} has no {WEIGHTS_FILE} (only safetensors weights are read)")
    tensors = load_file(str(path / WEIGHTS_FILE))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in TARGETS:
            raise AdapterError(f"{where}: tensor {key} adapts a module this server cannot adapt")
        layer, target, which = int(match.group(1)), match.group(2), match.group(3)
        pairs.setdefault((layer, target), {})[which] = tensor.float()
    weights = {}
    rslora = bool(config.get("use_rslora", False))
    for (layer, target), pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{where}: layer {layer} {target} lacks its lora_A or lora_B")
        a, b = pair["A"], pair["B"]
        rank = a.shape[0]
        block = "self_attn" if target in ATTENTION_TARGETS else "mlp"
        module = f"model.layers.{layer}.{block}.{target}"
        alpha = float(_pattern(config.get("alpha_pattern") or {}, module, config["lora_alpha"]))
        scaling = alpha / (math.sqrt(rank) if rslora else rank)
        weights[(layer, target)] = (a.contiguous(), (b * scaling).contiguous())
    return LoraAdapter(name, path, weights)


def _check_config(config: dict, where: str) -> None:
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{where} is a {config.get('peft_type')} adapter, not LoRA")
    if config.get("use_dora"):
        raise AdapterError(f"{where} is a DoRA adapter, which this server does not run")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{where} trains biases (bias={config['bias']!r}), not supported")
    if config.get("modules_to_save"):
        raise AdapterError(
            f"{where} saves whole modules ({config['modules_to_save']}), not supported"
        )
    if "lora_alpha" not in config:
        raise AdapterError(f"{where}: {CONFIG_FILE} has no lora_alpha")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        return  # a regular expression: the tensors' names are checked one by one instead
    unsupported = sorted(set(targets) - set(TARGETS))
    if unsupported:
        raise AdapterError(
            f"{where} targets {', '.join(unsupported)}; only {', '.join(TARGETS)} can be adapted"
        )


def _pattern(patterns: dict[str, float], module: str, default: float) -> float:
    """PEFT's per-module override: the first key that matches the module's name's tail."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default

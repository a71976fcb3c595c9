"""`ClassifierHead`: what a BERT cross-encoder (`BertForSequenceClassification`, as
sentence-transformers' `CrossEncoder` loads it) adds to the encoder: the pooler (dense and
tanh on the [CLS] token's hidden state), the classifier's linear layer, and the activation
`CrossEncoder.predict` applies to the logits.

The activation is read from the same places, in the same order, as CrossEncoder reads it
(sentence-transformers 6.2, `CrossEncoder._parse_model_config` then
`get_default_activation_fn`): `activation_fn` in `config_sentence_transformers.json`, then
`sentence_transformers.activation_fn` in `config.json`, then the older
`sbert_ce_default_activation_function`, else sigmoid for one label. A path outside `torch.`
is code CrossEncoder runs only with `trust_remote_code`; without it, as here, it falls back
to the default. The head computes in float32 whatever the encoder's dtype, as CrossEncoder
upcasts its scores before the activation.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from model.errors import ModelFileError, UnsupportedModelError

logger = logging.getLogger(__name__)

CROSS_ENCODER_ARCHITECTURES = ("BertForSequenceClassification",)
# torch's activation modules by class name, as CrossEncoder writes them
# (`torch.nn.modules.activation.Sigmoid`) or a user may (`torch.nn.Sigmoid`).
ACTIVATIONS = {"Sigmoid": torch.sigmoid, "Identity": lambda x: x, "Tanh": torch.tanh}
_HEAD_TENSORS = {
    "pooler.dense.weight": "pooler.weight",
    "pooler.dense.bias": "pooler.bias",
    "classifier.weight": "classifier.weight",
    "classifier.bias": "classifier.bias",
}


def is_cross_encoder(hf: dict[str, Any]) -> bool:
    architectures = hf.get("architectures") or []
    return isinstance(architectures, list) and any(
        a in CROSS_ENCODER_ARCHITECTURES for a in architectures
    )


def head_tensor_name(hf_name: str) -> str | None:
    """Our head's parameter for a checkpoint tensor; None for the encoder's."""
    return _HEAD_TENSORS.get(hf_name.removeprefix("bert."))


class ClassifierHead(nn.Module):
    def __init__(self, dim: int, num_labels: int, activation: str) -> None:
        super().__init__()
        self.pooler = nn.Linear(dim, dim)
        self.classifier = nn.Linear(dim, num_labels)
        self.activation = activation

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """hidden: [sum(lengths), dim], the sequences one after another. Returns
        [len(lengths), num_labels] float32 scores."""
        sizes = torch.tensor(lengths, device=hidden.device)
        first = sizes.cumsum(0) - sizes  # each sequence's [CLS] row
        pooled = torch.tanh(self.pooler(hidden[first].float()))
        return ACTIVATIONS[self.activation](self.classifier(pooled))

    @torch.no_grad()
    def load_weights(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        params = dict(self.named_parameters())
        missing = sorted(set(params) - set(tensors))
        if missing:
            raise ModelFileError(f"{source}: the classifier lacks its tensor {missing[0]}")
        for name, tensor in tensors.items():
            if tuple(params[name].shape) != tuple(tensor.shape):
                raise ModelFileError(
                    f"{source}: classifier tensor {name} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(params[name].shape)}"
                )
            params[name].copy_(tensor)


def build_head(path: Path, hf: dict[str, Any], dim: int) -> ClassifierHead:
    """An empty head for the cross-encoder in `path`; refuses what rerank cannot rank by
    (more than one label)."""
    labels = hf.get("id2label")
    num_labels = len(labels) if isinstance(labels, dict) else int(hf.get("num_labels", 2))
    if num_labels != 1:
        raise UnsupportedModelError(
            f"{path / 'config.json'}: a classifier of {num_labels} labels; only cross-encoders "
            "with one label (one relevance score) are served"
        )
    return ClassifierHead(dim, num_labels, activation_name(path, hf))


def activation_name(path: Path, hf: dict[str, Any]) -> str:
    """The class name in ACTIVATIONS CrossEncoder would apply to this model's logits."""
    st_config = path / "config_sentence_transformers.json"
    if st_config.is_file():
        try:
            chosen = json.loads(st_config.read_text()).get("activation_fn")
        except (OSError, json.JSONDecodeError, AttributeError):
            raise ModelFileError(f"{st_config}: not readable JSON") from None
        if chosen is not None and (name := _trusted(chosen, st_config)) is not None:
            return name
    st_fields = hf.get("sentence_transformers")
    if isinstance(st_fields, dict) and "activation_fn" in st_fields:
        chosen = st_fields["activation_fn"]
    else:
        chosen = hf.get("sbert_ce_default_activation_function")
    if chosen is not None and (name := _trusted(chosen, path / "config.json")) is not None:
        return name
    return "Sigmoid"  # one label: CrossEncoder's default


def _trusted(dotted: object, source: Path) -> str | None:
    if not isinstance(dotted, str) or not dotted.startswith("torch."):
        logger.warning(
            "%s: activation %r is not torch's; using the default, as CrossEncoder does without "
            "trust_remote_code",
            source,
            dotted,
        )
        return None
    name = dotted.rsplit(".", 1)[-1]
    if name not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"{source}: activation {dotted} is not supported (one of "
            f"{', '.join(sorted(ACTIVATIONS))})"
        )
    return name

"""Pooling: one vector per sequence from the hidden states of its tokens, as the
sentence-transformers `Pooling` and `Normalize` modules compute it.

`mean` averages every token (an encoder's [CLS] and [SEP] included, as
sentence-transformers does), `cls` takes the first, `last` the last (decoder embedders,
whose last token has seen the whole input). Normalisation makes cosine similarity a dot
product, which retrieval stores rely on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import torch

POOLING_MODES = ("mean", "cls", "last")


class PoolingConfigError(ValueError):
    """A pooling override that is not one; one sentence for the CLI."""


@dataclass(frozen=True)
class PoolingConfig:
    mode: str = "mean"
    normalize: bool = True

    def overridden(self, spec: str | None) -> PoolingConfig:
        """`spec`: a mode name (`mean`) or vLLM's pooler-config JSON
        (`{"pooling_type": "CLS", "normalize": false}`); None keeps this config."""
        if spec is None:
            return self
        if spec.lstrip().startswith("{"):
            try:
                fields = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise PoolingConfigError(f"--pooling is not valid JSON: {exc.msg}") from None
            if not isinstance(fields, dict) or set(fields) - {"pooling_type", "normalize"}:
                raise PoolingConfigError("--pooling JSON takes only pooling_type and normalize")
            config = self
            if "pooling_type" in fields:
                config = replace(config, mode=_mode(str(fields["pooling_type"])))
            if "normalize" in fields:
                if not isinstance(fields["normalize"], bool):
                    raise PoolingConfigError("--pooling normalize must be true or false")
                config = replace(config, normalize=fields["normalize"])
            return config
        return replace(self, mode=_mode(spec))


def _mode(name: str) -> str:
    mode = name.strip().lower()
    if mode not in POOLING_MODES:
        raise PoolingConfigError(
            f"unknown pooling {name!r}: expected one of {', '.join(POOLING_MODES)}"
        )
    return mode


def pool(hidden: torch.Tensor, lengths: list[int], config: PoolingConfig) -> torch.Tensor:
    """hidden: [sum(lengths), D], the sequences' tokens one after another. Returns
    [len(lengths), D] in float32."""
    hidden = hidden.float()
    if config.mode == "mean":
        index = torch.repeat_interleave(
            torch.arange(len(lengths), device=hidden.device),
            torch.tensor(lengths, device=hidden.device),
        )
        sums = torch.zeros(len(lengths), hidden.shape[1], device=hidden.device)
        sums.index_add_(0, index, hidden)
        pooled = sums / torch.tensor(lengths, device=hidden.device, dtype=torch.float32)[:, None]
    else:
        sizes = torch.tensor(lengths, device=hidden.device)
        ends = sizes.cumsum(0)
        rows = ends - sizes if config.mode == "cls" else ends - 1
        pooled = hidden[rows]
    if config.normalize:
        pooled = torch.nn.functional.normalize(pooled, p=2.0, dim=-1)
    return pooled

"""`ModelConfig`: the hyper-parameters of a network of one of the supported families
(model/families/), read from an HF `config.json`, from GGUF metadata or from a Meta
checkpoint's `params.json`.

Owns the translation of every checkpoint format's names into one set of fields and the
refusal of shapes we cannot run. Must never touch weights or tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.errors import UnsupportedModelError
from model.families import MOE_FAMILIES, family_for_gguf, family_for_hf
from model.rope_scaling import SUPPORTED_ROPE_TYPES, RopeScaling, rope_scaling

__all__ = ["SUPPORTED_ROPE_TYPES", "ModelConfig", "RopeScaling", "meta_ffn_dim"]


@dataclass(frozen=True)
class ModelConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position: int = 2048
    tie_embeddings: bool = False
    architecture: str = "llama"
    # What a family adds to Llama's layer (model/families/).
    qkv_bias: bool = False  # Qwen2: a bias on the Q, K and V projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head
    sliding_window: int | None = None  # Mistral v0.1: attend to the last N positions only
    # Gemma 3:
    full_attention_layers: tuple[int, ...] = ()  # layers the window does not apply to
    rope_local_theta: float | None = None  # the RoPE base of the windowed layers
    hidden_act: str = "silu"  # or "gelu_tanh": the gated MLP's activation
    embed_scale: float = 1.0  # embeddings are multiplied by it (Gemma: sqrt(dim))
    sandwich_norms: bool = False  # an RMSNorm after attention and after the MLP too
    query_scale: float | None = None  # attention scale; None: head_dim ** -0.5
    # OLMoE: one RMSNorm over the whole Q and K projections rather than over each head.
    qk_norm_whole: bool = False
    # Mixture of experts (Qwen3-MoE, OLMoE, Mixtral; model/network/moe.py): a softmax router picks
    # `n_experts_used` of `n_experts` SwiGLU experts of width `expert_ffn_dim` per token, their
    # weights renormalised to sum to 1 where `norm_topk_prob`; `dense_layers` keep a dense
    # MLP of width `ffn_dim`.
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn_dim: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()
    # gpt-oss: a bias on the O projection; a learned logit per query head that joins each
    # softmax's denominator (an attention sink); biases on the router and on every expert
    # projection; experts gated as (clamp(up) + 1) * g * sigmoid(swiglu_alpha * g) with
    # g = min(gate, swiglu_limit), where a limit is set.
    o_bias: bool = False
    attention_sinks: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise UnsupportedModelError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim={self.head_dim} must be even for RoPE")

    def window_of(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, or None where it sees the whole context."""
        if self.sliding_window is None or layer in self.full_attention_layers:
            return None
        return self.sliding_window

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return self.n_experts > 0 and layer not in self.dense_layers

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.n_heads // self.n_kv_heads

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        attn = self.dim * (self.q_size + 2 * self.kv_size) + self.q_size * self.dim
        dense = 3 * self.dim * self.ffn_dim
        sparse = self.n_experts * (3 * self.dim * self.expert_ffn_dim + self.dim)
        sparse += self.n_experts * (2 * self.expert_ffn_dim + self.dim + 1) * self.expert_bias
        n_sparse = sum(self.is_sparse(i) for i in range(self.n_layers))
        ffn = n_sparse * sparse + (self.n_layers - n_sparse) * dense
        norms = (4 if self.sandwich_norms else 2) * self.dim
        norms += 2 * self.head_dim if self.qk_norm else 0
        norms += self.q_size + self.kv_size if self.qk_norm_whole else 0
        attn += (self.q_size + 2 * self.kv_size) if self.qkv_bias else 0
        attn += self.dim * self.o_bias + self.n_heads * self.attention_sinks
        embed = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * (attn + norms) + ffn + self.dim + embed

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        model_type = cfg.get("model_type", "llama")
        family = family_for_hf(model_type, source)
        extra = family.hf_fields(cfg, source)
        if "hidden_act" not in extra and cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"{source}: unsupported hidden_act {cfg['hidden_act']!r}")
        n_heads = cfg["num_attention_heads"]
        dim = cfg["hidden_size"]
        # transformers 5 nests theta and scaling in `rope_parameters`; older files use
        # `rope_theta` + `rope_scaling`.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        # A family's own RoPE fields (Gemma 3's per-layer-type bases) replace these.
        rope = extra.pop("rope", rope)
        theta = extra.pop("rope_theta", theta)
        return cls(
            dim=dim,
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or dim // n_heads,
            ffn_dim=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=rope_scaling(rope, source),
            max_position=cfg.get("max_position_embeddings", 2048),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            architecture=family.name,
            **extra,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        try:
            cfg = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UnsupportedModelError(f"{file}: cannot read model config ({exc})") from None
        try:
            return cls.from_hf_dict(cfg, source=str(file))
        except KeyError as exc:
            raise UnsupportedModelError(f"{file}: missing field {exc}") from None

    @classmethod
    def from_gguf_metadata(
        cls, md: dict[str, Any], tensor_names: set[str], source: str = "GGUF"
    ) -> ModelConfig:
        family = family_for_gguf(md.get("general.architecture"), source)
        prefix = f"{md['general.architecture']}."
        arch = {k.removeprefix(prefix): v for k, v in md.items() if k.startswith(prefix)}
        try:
            dim = arch["embedding_length"]
            n_heads = arch["attention.head_count"]
            head_dim = arch.get("attention.key_length") or dim // n_heads
            rot_dims = arch.get("rope.dimension_count", head_dim)
            if rot_dims != head_dim:
                raise UnsupportedModelError(
                    f"{source}: partial rotary embeddings ({rot_dims} of {head_dim} dims) "
                    "are not supported"
                )
            vocab = arch.get("vocab_size") or len(md["tokenizer.ggml.tokens"])
            extra = family.gguf_fields(arch, source)
            # A family that reads its own RoPE scaling (gpt-oss's YaRN) hands it over.
            scaling: dict[str, Any] = extra.pop("rope", {})
            if not scaling and arch.get("rope.scaling.type") == "linear":
                scaling = {"rope_type": "linear", "factor": arch["rope.scaling.factor"]}
            elif not scaling and arch.get("rope.scaling.type") not in (None, "none"):
                raise UnsupportedModelError(
                    f"{source}: unsupported rope scaling {arch['rope.scaling.type']!r}"
                )
            if extra.get("n_experts"):
                extra["dense_layers"] = tuple(
                    i
                    for i in range(arch["block_count"])
                    if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names
                )
            elif arch.get("expert_count"):
                raise UnsupportedModelError(
                    f"{source}: a mixture-of-experts {family.name!r} GGUF is not supported; "
                    f"llamaserve runs mixture-of-experts {MOE_FAMILIES}"
                )
            return cls(
                dim=dim,
                n_layers=arch["block_count"],
                n_heads=n_heads,
                n_kv_heads=arch.get("attention.head_count_kv") or n_heads,
                head_dim=head_dim,
                ffn_dim=arch["feed_forward_length"],
                vocab_size=vocab,
                norm_eps=arch.get("attention.layer_norm_rms_epsilon", 1e-5),
                rope_theta=float(arch.get("rope.freq_base", 10000.0)),
                rope_scaling=rope_scaling(scaling, source),
                max_position=arch.get("context_length", 2048),
                tie_embeddings="output.weight" not in tensor_names,
                architecture=family.name,
                **extra,
            )
        except KeyError as exc:
            raise UnsupportedModelError(f"{source}: missing GGUF metadata {exc}") from None

    @classmethod
    def from_meta_params(
        cls, params: dict[str, Any], tensor_names: set[str], source: str = "params.json"
    ) -> ModelConfig:
        """Meta's `params.json`, read with the defaults of Meta's Llama 3 `ModelArgs`."""
        unsupported = sorted(k for k in params if k.startswith(_META_UNSUPPORTED_PREFIXES))
        if unsupported:
            raise UnsupportedModelError(
                f"{source}: {', '.join(unsupported)}: vision, mixture-of-experts and quantised "
                "Meta checkpoints are not supported"
            )
        try:
            dim, n_layers, n_heads = params["dim"], params["n_layers"], params["n_heads"]
            vocab_size = params["vocab_size"]
        except KeyError as exc:
            raise UnsupportedModelError(f"{source}: missing field {exc}") from None
        if vocab_size <= 0:
            raise UnsupportedModelError(
                f"{source}: vocab_size {vocab_size} (Llama 1/2 checkpoints) is not supported"
            )
        scaling = RopeScaling()
        if params.get("use_scaled_rope"):
            # Meta's reference code hard-codes factor 8; Llama 3.2 1B and 3B were trained with
            # 32 (their HF configs were corrected after release), which params.json omits.
            factor = params.get("rope_scaling_factor") or (
                32.0 if (dim, n_layers) in _LLAMA32_SMALL_SHAPES else 8.0
            )
            scaling = RopeScaling(rope_type="llama3", factor=float(factor))
        return cls(
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=params.get("n_kv_heads") or n_heads,
            head_dim=dim // n_heads,
            ffn_dim=meta_ffn_dim(
                dim, params.get("multiple_of", 256), params.get("ffn_dim_multiplier")
            ),
            vocab_size=vocab_size,
            norm_eps=params.get("norm_eps", 1e-5),
            rope_theta=float(params.get("rope_theta", 500000.0)),
            rope_scaling=scaling,
            # Not in params.json: Llama 3 was trained on 8K tokens, 3.1 and later extend to 128K.
            max_position=131072 if params.get("use_scaled_rope") else 8192,
            tie_embeddings="output.weight" not in tensor_names,
        )


# params.json keys of checkpoints that need more than a plain decoder stack.
_META_UNSUPPORTED_PREFIXES = ("vision_", "moe", "quantization_args", "lora_args")
# (dim, n_layers) of Llama 3.2 1B and 3B.
_LLAMA32_SMALL_SHAPES = {(2048, 16), (3072, 28)}


def meta_ffn_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """SwiGLU width as Meta's `FeedForward` computes it: 2/3 of 4 * dim, times the multiplier,
    rounded up to a multiple of `multiple_of` (each step truncated to an int, as there)."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)

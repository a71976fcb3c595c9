"""The network every supported family shares: embeddings, decoder layers
(model/network/decoder_layer.py), final norm and output projection (or, for an embedder, the final
hidden states), over one flat `Batch` and a paged cache. A pure function of tensors: it
knows nothing of requests, sampling or block allocation. `load_weights` takes HF-named
tensors in the HF (rotate-halves) RoPE layout and fills the fused ones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from model.attention.base import AttentionBackend
from model.attention.torch_ref import TorchRefBackend
from model.checkpoint.file_blocks import FileBlocks
from model.config import ModelConfig
from model.native.layer_stack import NativeLayerStack
from model.network.batch import Batch
from model.network.decoder_layer import DecoderLayer, NormKernel, RMSNorm, RopeKernel
from model.network.meta_init import materialise, skeleton
from model.network.paged_cache import PagedKVCache
from model.network.rope import rotary_embeddings
from model.network.weight_names import load_named_weights
from model.parallel.comm import all_reduce, gather_vocab
from model.parallel.plan import TensorParallel
from model.plan.kernel_plan import KernelPlan
from model.plan.layer_formats import split_rows
from model.quant.base import QuantizedLinear
from model.quant.factory import quantized_layer
from model.quant.int6 import Int6Linear
from model.quant.int8_group import Int8GroupLinear
from model.quant.split import PARTS, SplitLinear

logger = logging.getLogger(__name__)
# Linear layers ('layers.3.down_proj') in another quantization than the model's.
LayerQuantizations = Mapping[str, str]
# The kernel plan's int4 kernel per (int4 or w4a8, in, out) (model/plan/int4_kernel.py).
Int4Kernels = Mapping[tuple[str, int, int], str]


class Llama(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        max_position: int | None = None,
        attention: AttentionBackend | None = None,
        device: torch.device | str = "cpu",
        tp: TensorParallel | None = None,
    ) -> None:
        """With `tp`, this rank's share of the model (model/parallel/plan.py): `config`
        becomes the rank's own shapes (its heads, KV heads and FFN rows; the vocabulary
        stays whole, as the logits are), which is also what sizes its KV cache."""
        super().__init__()
        self.tp = tp
        self.config = tp.local_config(config) if tp else config
        self.vocab_rows = tp.vocab_rows(config.vocab_size) if tp else (0, config.vocab_size)
        vocab_rows = self.vocab_rows[1] - self.vocab_rows[0]
        self.attention = attention or TorchRefBackend()
        # What the model runs on, set with its kernels (model/plan/kernel_plan.py).
        self.kernel_plan: KernelPlan | None = None
        # Rank 0 of a tensor-parallel group broadcasts each step here (model/parallel/steps.py).
        self.before_forward: Callable[[Batch, PagedKVCache], None] | None = None
        self.embed_tokens = nn.Embedding(vocab_rows, config.dim)
        self.layers = nn.ModuleList(DecoderLayer(self.config, i) for i in range(config.n_layers))
        self.windows = [self.config.window_of(i) for i in range(config.n_layers)]
        self.layer_stack: NativeLayerStack | None = None  # set by `use_native_layers`
        if tp:
            for layer in self.layers:
                layer.reduce = all_reduce
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, vocab_rows, bias=False)
        # Set by `quantize_head` on a tied model: the embedding is looked up in the output
        # projection's int8 weight, and embed_tokens keeps no rows.
        self.embed_from_head = False
        self.tie_weights()
        if torch.device(device).type != "meta":  # else `empty` makes them on its device
            self.rope, self.rope_local = rotary_embeddings(config, max_position, device)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype, the residual stream's."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def tie_weights(self) -> None:
        # A quantised output projection is its own packed copy of the embedding.
        if self.config.tie_embeddings and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight = self.embed_tokens.weight

    def use_native_norm(self, kernel: NormKernel | None) -> None:
        """Every RMSNorm runs `kernel` (None: back to PyTorch): one call instead of about
        nine small ops per norm, 0.5-2.7 ms per decode step of the default model on 2 cores."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.native = kernel

    def use_rope_kernel(self, kernel: RopeKernel | None) -> None:
        """Every layer rotates Q and K with `kernel` (None: back to PyTorch)."""
        for layer in self.layers:
            layer.rope_kernel = kernel

    def use_native_layers(self) -> int:
        """Native decoder layers where their parts fit (model/native/layer.py): how many;
        where all fit with dense MLPs, a step of decodes runs them in one call."""
        native = sum(layer.use_native() for layer in self.layers)
        self.layer_stack = NativeLayerStack.for_layers(self.layers, self.windows)
        sparse = sum(layer.moe is not None for layer in self.layers)
        if sparse:
            in_c = sum(
                layer.moe is not None and layer.moe.native is not None for layer in self.layers
            )
            whole = sum(
                layer.native is not None and layer.native.moe is not None for layer in self.layers
            )
            logger.info(
                "mixture of experts: %d of %d layers run attention in the C decoder layer; "
                "%d of the %d sparse layers run their experts in one C call (%d with the "
                "router, in the C layer's call), the rest in PyTorch on their quantised "
                "layers' kernels",
                native,
                len(self.layers),
                in_c,
                sparse,
                whole,
            )
        return native

    def quantize_linears(
        self,
        quantization: str | None,
        layer_quantizations: LayerQuantizations | None = None,
        int4_kernels: Int4Kernels | None = None,
    ) -> None:
        """Swaps every decoder linear layer for an empty quantised one before loading, so
        weights stream straight into the quantised form (each layer named in
        `layer_quantizations` into its own). The output projection keeps the model dtype: 4
        bits cost the most there (GGUF files keep it at 8 bits or more), and a tied one
        shares the embedding. int4 layers run on `int4_kernels`' choice for their shape
        (none: PyTorch's)."""
        layer_quantizations = layer_quantizations or {}
        int4_kernels = int4_kernels or {}
        for index, layer in enumerate(self.layers):
            # A mixture of experts' linear layers sit one level down ('moe.experts.3.down_proj').
            for name, child in list(layer.named_modules()):
                if isinstance(child, nn.Linear):
                    key = f"layers.{index}.{name}"
                    own = layer_quantizations.get(key, quantization)
                    if own is None:  # a float model's layer: stays as it is
                        continue
                    owner, _, attr = name.rpartition(".")
                    parent = layer.get_submodule(owner) if owner else layer
                    shape = (child.in_features, child.out_features)
                    v_rows = split_rows(layer.config)[1]  # a split Q/K/V layer's V
                    module = quantized_layer(own, *shape, v_rows, int4_kernels)
                    setattr(parent, attr, module)

    def quantize_head(self, int6: bool = False, int8_activations: bool = False) -> None:
        """Swaps the output projection for an empty grouped-int8 one (or an int6 one, for a
        Q6_K head; either on int8 activations with `int8_activations`), before loading; a
        tied embedding then reads its rows from it rather than holding a copy."""
        shape = (self.lm_head.in_features, self.lm_head.out_features, "meta")
        self.lm_head = (
            Int6Linear(*shape, logits=True, int8_activations=int8_activations)
            if int6
            else Int8GroupLinear(*shape, int8_activations=int8_activations)
        )
        if self.config.tie_embeddings and not self.tp:
            self.embed_from_head = True
            self.embed_tokens = nn.Embedding(0, self.config.dim, device="meta")

    def quantized_modules(self) -> dict[str, QuantizedLinear]:
        """Parameter-style names ('layers.0.qkv_proj.weight') of the quantised layers."""
        modules = {n: m for n, m in self.named_modules() if isinstance(m, QuantizedLinear)}
        # A split layer's parts are loaded through it.
        parts = {
            f"{n}.{p}" for n, m in modules.items() if isinstance(m, SplitLinear) for p in PARTS
        }
        return {f"{n}.weight": m for n, m in modules.items() if n not in parts}

    @classmethod
    def empty(
        cls,
        config: ModelConfig,
        max_position: int | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        quantization: str | None = None,
        tp: TensorParallel | None = None,
        head_int8: bool = False,
        head_int6: bool = False,
        head_int8_activations: bool = False,
        layer_quantizations: LayerQuantizations | None = None,
        int4_kernels: Int4Kernels | None = None,
    ) -> Llama:
        """A model with uninitialised weights: random init of a model about to be loaded
        costs seconds for nothing. With `quantization`, the linear layers are quantised
        ones, filled as the weights load (`layer_quantizations`' layers in their own); with
        `head_int8`, the output projection too (grouped int8, model/quant/, or
        with `head_int6` int6, model/quant/int6.py, on int8 activations with
        `head_int8_activations`)."""
        with skeleton():
            model = cls(config, max_position, device="meta", tp=tp)
            if quantization is not None or layer_quantizations:
                model.quantize_linears(quantization, layer_quantizations, int4_kernels)
            if head_int8:
                model.quantize_head(head_int6, head_int8_activations)
        # The dtype is set while the tensors are still shapes: materialising in fp32 and
        # then casting held both copies of the embedding at once.
        model = materialise(model, dtype, device)
        for module in model.modules():
            # Each kernel reads its scales in its own dtype, whatever the model's.
            if isinstance(module, QuantizedLinear) and not isinstance(module, SplitLinear):
                module.to(module.scale_dtype)
        model.tie_weights()  # materialising gives the tied weight two separate storages
        model.rope, model.rope_local = rotary_embeddings(config, max_position, device)
        return model

    @torch.inference_mode()
    def forward(
        self, batch: Batch, kv_cache: PagedKVCache, logit_rows: int | None = None
    ) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] in fp32; with `logit_rows`, of the
        first that many token ids only (a draft model's guesses among the common tokens:
        scheduler/runner/draft_model.py)."""
        if self.before_forward is not None:
            self.before_forward(batch, kv_cache)
        h = self.norm(self._layers(batch, kv_cache)[batch.logits_indices])
        logits = self._head(h, logit_rows).float()
        if self.tp:
            logits = gather_vocab(logits, self.config.vocab_size)
        return logits

    def _head(self, h: torch.Tensor, rows: int | None) -> torch.Tensor:
        """The output projection, over the first `rows` token ids where given: the packed
        heads keep whole tiles of 16 ids, each after the one before, so their first rows
        are a prefix of their bytes, and the rest is never read."""
        head = self.lm_head
        if rows is None or rows >= head.out_features:
            return head(h)
        if isinstance(head, nn.Linear):
            return nn.functional.linear(h, head.weight[:rows])
        if isinstance(head, Int8GroupLinear | Int6Linear):
            return head.first_outputs(h, rows)
        return head(h)[..., :rows]

    @torch.inference_mode()
    def hidden_states(self, batch: Batch, kv_cache: PagedKVCache) -> torch.Tensor:
        """The final norm's output for every token of the batch, [T, dim]: what an
        embedder pools (transformers' last `hidden_states`)."""
        return self.norm(self._layers(batch, kv_cache))

    def _layers(self, batch: Batch, kv_cache: PagedKVCache) -> torch.Tensor:
        attention = self.attention
        plan = attention.plan(batch)
        h = self._embed(batch.input_ids)
        rope = self.rope(batch.positions)
        local_rope = self.rope_local(batch.positions) if self.rope_local is not None else rope
        stack, decodes = self.layer_stack, getattr(plan, "decodes", None)
        if stack is not None and decodes is not None and batch.lora_slots is None:
            out = stack.decode(self.layers, h, rope, local_rope, kv_cache, decodes)
            if out is not None:
                return out
        for layer, window, (k_cache, v_cache) in zip(
            self.layers, self.windows, kv_cache.layers, strict=True
        ):
            angles = local_rope if window is not None else rope
            h = layer(h, batch, angles, attention, plan, k_cache, v_cache, window)
        return h

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        h = self._lookup(ids)
        if self.config.embed_scale != 1.0:  # in the embedding's dtype, as Gemma does
            h = h * torch.tensor(self.config.embed_scale, dtype=h.dtype)
        return h

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_from_head:
            return self.lm_head.embed(ids, self.dtype)
        if not self.tp:
            return self.embed_tokens(ids)
        # Each rank looks up the ids in its vocabulary rows; exactly one rank has each.
        start, end = self.vocab_rows
        inside = (ids >= start) & (ids < end)
        h = self.embed_tokens((ids - start).clamp(0, end - start - 1))
        return all_reduce(h * inside.unsqueeze(1).to(h.dtype))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | FileBlocks]]) -> None:
        """Copies HF-named tensors into the (fused) parameters (model/network/weight_names.py)."""
        load_named_weights(self, weights)

"""A GGUF file: config, tokenizer and template from its metadata, weights dequantised from
its blocks (llama.cpp's row order of Q and K undone)."""

from __future__ import annotations

from pathlib import Path

import torch

from model.checkpoint.base import Checkpoint, Weights, named_tokenizer
from model.checkpoint.default_model import DEFAULT_MODEL_NAME, default_model_path_or_none
from model.checkpoint.dequant import FLOAT_TYPES
from model.checkpoint.file_blocks import HELD_BLOCK_TYPES, LAYER_BLOCK_TYPES
from model.checkpoint.gguf_file import open_gguf
from model.checkpoint.gguf_weights import (
    check_tensor_types,
    count_gguf_tensors,
    iter_gguf_weights,
    linear_weight_bits,
    linears_all_in,
    output_block_type,
    output_quantized,
    split_qkv_linears,
    wide_linears,
)
from model.checkpoint.packed_embedding import PackedEmbedding
from model.config import ModelConfig
from model.parallel.plan import TensorParallel
from model.text.chat_template import ChatTemplate
from model.text.tokenizer import Tokenizer
from model.text.tokenizer_files import tokenizer_from_gguf


class GGUFCheckpoint(Checkpoint):
    def __init__(self, path: Path) -> None:
        self.path = path
        self.gguf = open_gguf(path)
        check_tensor_types(self.gguf)
        names = {t.name for t in self.gguf.tensors}
        self.config = ModelConfig.from_gguf_metadata(self.gguf.metadata, names, source=str(path))
        self.num_tensors = count_gguf_tensors(self.gguf, self.config)
        self.checkpoint_bits = linear_weight_bits(self.gguf)
        self.wide_linears = wide_linears(self.gguf)
        self.q5_0_linears = linears_all_in(self.gguf, "Q5_0")
        self.q6_k_linears = linears_all_in(self.gguf, "Q6_K")
        self.split_qkv_linears = split_qkv_linears(self.gguf)
        self.mxfp4_linears = linears_all_in(self.gguf, "MXFP4")
        self.head_quantized = output_quantized(self.gguf)
        self.head_block_type = output_block_type(self.gguf)
        self._handed_over: set[str] = set()  # by `packed_embedding`
        self.name = DEFAULT_MODEL_NAME if path == default_model_path_or_none() else path.stem

    def weights(
        self, dtype: torch.dtype, tp: TensorParallel | None, file_blocks: bool = False
    ) -> tuple[Weights, bool]:
        # The loader cuts a rank's slices from whole tensors, so under `tp` none comes in
        # blocks of rows, nor undecoded.
        blocks, skip = tp is None, frozenset(self._handed_over)
        held = LAYER_BLOCK_TYPES if file_blocks else HELD_BLOCK_TYPES
        undecoded = held if tp is None else frozenset()
        self.num_tensors = count_gguf_tensors(self.gguf, self.config, blocks, skip, undecoded)
        weights = iter_gguf_weights(
            self.gguf, self.config, dtype, row_blocks=blocks, skip=skip, file_blocks=undecoded
        )
        return weights, False

    def packed_embedding(self, dtype: torch.dtype) -> PackedEmbedding | None:
        """The token embedding left in the file's own blocks, where the file stores it
        quantised and apart from the output projection; `weights` then leaves it out."""
        tensor = next((t for t in self.gguf.tensors if t.name == "token_embd.weight"), None)
        if tensor is None or tensor.tensor_type in FLOAT_TYPES or self.config.tie_embeddings:
            return None
        self._handed_over.add(tensor.name)
        dim, rows = tensor.shape
        return PackedEmbedding(self.path, tensor.offset, rows, dim, tensor.tensor_type, dtype)

    def tokenizer(self) -> Tokenizer:
        return named_tokenizer(self.path, tokenizer_from_gguf, self.gguf.metadata)

    def chat_template(self, tokenizer: Tokenizer) -> ChatTemplate | None:
        return ChatTemplate.from_gguf_metadata(self.gguf.metadata, tokenizer)

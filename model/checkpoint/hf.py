"""A Hugging Face directory: `config.json`, safetensors shards, `tokenizer.json` and
`tokenizer_config.json`; each family renames or reshapes its tensors on the way in
(model/families/)."""

from __future__ import annotations

from pathlib import Path

import torch

from model.checkpoint.base import Checkpoint, Weights, named_tokenizer
from model.checkpoint.hf_mxfp4 import hf_mxfp4_linears, join_mxfp4_pairs
from model.checkpoint.safetensors import count_tensors, iter_safetensors, safetensors_files
from model.config import ModelConfig
from model.families import FAMILIES
from model.parallel.plan import TensorParallel
from model.text.chat_template import ChatTemplate
from model.text.tokenizer import Tokenizer
from model.text.tokenizer_files import tokenizer_from_hf_dir


class HFCheckpoint(Checkpoint):
    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = path.name
        self.config = ModelConfig.from_hf_dir(path)
        self.files = safetensors_files(path)
        self.num_tensors = count_tensors(self.files)
        self.mxfp4_linears = hf_mxfp4_linears(path, self.config)

    def weights(
        self, dtype: torch.dtype, tp: TensorParallel | None, file_blocks: bool = False
    ) -> tuple[Weights, bool]:
        # Each rank reads only its own slices from disk.
        cut = tp.cut(self.config) if tp is not None else None
        tensors = join_mxfp4_pairs(iter_safetensors(self.files, dtype, cut=cut), dtype)
        family = FAMILIES[self.config.architecture]
        adapted = (pair for name, tensor in tensors for pair in family.hf_tensors(name, tensor))
        return adapted, tp is not None

    def tokenizer(self) -> Tokenizer:
        return named_tokenizer(self.path, tokenizer_from_hf_dir, self.path)

    def chat_template(self, tokenizer: Tokenizer) -> ChatTemplate | None:
        return ChatTemplate.from_hf_dir(self.path, tokenizer)

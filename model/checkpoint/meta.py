"""A Meta checkpoint directory: `params.json`, `consolidated.NN.pth` (one per
model-parallel rank, read as one rank's slices where their number matches) and Meta's
tiktoken `tokenizer.model`."""

from __future__ import annotations

from pathlib import Path

import torch

from model.checkpoint.base import Checkpoint, Weights
from model.checkpoint.meta_weights import (
    count_meta_tensors,
    files_match_ranks,
    iter_meta_rank_weights,
    iter_meta_weights,
    open_meta_checkpoint,
)
from model.config import ModelConfig
from model.errors import ModelFileError, TokenizerError
from model.parallel.plan import TensorParallel
from model.text.llama3_tokenizer import llama3_tokenizer
from model.text.tokenizer import Tokenizer


class MetaCheckpointDir(Checkpoint):
    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = path.name
        self.checkpoint = open_meta_checkpoint(path)
        self.config = ModelConfig.from_meta_params(
            self.checkpoint.params,
            self.checkpoint.tensor_names,
            source=str(path / "params.json"),
        )
        self.num_tensors = count_meta_tensors(self.checkpoint)

    def weights(
        self, dtype: torch.dtype, tp: TensorParallel | None, file_blocks: bool = False
    ) -> tuple[Weights, bool]:
        if tp is not None and files_match_ranks(self.checkpoint, self.config, tp.size):
            return iter_meta_rank_weights(self.checkpoint, self.config, tp.rank, dtype), True
        return iter_meta_weights(self.checkpoint, self.config, dtype), False

    def tokenizer(self) -> Tokenizer:
        file = self.path / "tokenizer.model"
        if not file.is_file():
            raise ModelFileError(f"{self.path}: Meta checkpoint has no tokenizer.model")
        tokenizer = read_llama3_tokenizer(file)
        if tokenizer.vocab_size > self.config.vocab_size:
            raise ModelFileError(
                f"{file}: {tokenizer.vocab_size} tokens, more than the model's vocab_size "
                f"{self.config.vocab_size}"
            )
        return tokenizer


def read_llama3_tokenizer(file: Path) -> Tokenizer:
    try:
        return llama3_tokenizer(file)
    except TokenizerError as exc:  # its message already names the file
        raise ModelFileError(str(exc)) from None

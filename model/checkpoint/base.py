"""What every checkpoint format answers (model/checkpoint/__init__.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from model.checkpoint.file_blocks import FileBlocks
from model.config import ModelConfig
from model.errors import ModelFileError, TokenizerError
from model.parallel.plan import TensorParallel
from model.text.chat_template import ChatTemplate
from model.text.tokenizer import Tokenizer

Weights = Iterator[tuple[str, torch.Tensor | FileBlocks]]


class Checkpoint(ABC):
    path: Path
    name: str
    config: ModelConfig
    num_tensors: int  # what `weights` yields, for the progress bar
    # The widest quantised type of the linear weights (4 for a Q4 GGUF), or None for float
    # weights: how far the weight format may requantise without losing what the file holds.
    checkpoint_bits: int | None = None
    # Linear layers ('layers.3.down_proj') stored in more than 4 bits beside 4-bit ones.
    wide_linears: frozenset[str] = frozenset()
    # Linear layers whose every matrix is GGUF Q5_0, or Q6_K (int5 and int6 hold them in
    # their own formats).
    q5_0_linears: frozenset[str] = frozenset()
    q6_k_linears: frozenset[str] = frozenset()
    # Fused Q/K/V layers whose V alone is stored wider than Q and K, with both block types.
    split_qkv_linears: Mapping[str, tuple[str, str]] = MappingProxyType({})
    # Linear layers whose every matrix is MXFP4: held so whatever the model's format.
    mxfp4_linears: frozenset[str] = frozenset()
    # The output projection is stored in a block type of at most 8 bits (grouped int8 holds it).
    head_quantized: bool = False
    # Its GGUF block type ("Q6_K": int6 holds it exactly), or None.
    head_block_type: str | None = None

    @abstractmethod
    def weights(
        self, dtype: torch.dtype, tp: TensorParallel | None, file_blocks: bool = False
    ) -> tuple[Weights, bool]:
        """HF-named tensors in `dtype` (quantised GGUF blocks dequantised), and whether
        they are already `tp`'s rank's slices (else the loader cuts them). Without `tp`, a
        large tensor may come as consecutive blocks of its rows under its one name. With
        `file_blocks`, a format that stores blocks some quantised layer holds as they are
        may hand them over undecoded (model/checkpoint/file_blocks.py)."""

    def packed_embedding(self, dtype: torch.dtype) -> torch.nn.Module | None:
        """The token embedding as a module that reads the file's quantised rows as they
        are looked up (model/checkpoint/packed_embedding.py), or None where the format has
        none; once handed over, `weights` leaves it out."""
        return None

    @abstractmethod
    def tokenizer(self) -> Tokenizer: ...

    def chat_template(self, tokenizer: Tokenizer) -> ChatTemplate | None:
        """The checkpoint's own Jinja template, None where it ships none."""
        return None


def named_tokenizer(path: Path, read: Callable[[Any], Tokenizer], source: Any) -> Tokenizer:
    """A tokenizer we cannot reproduce is one sentence naming the file, as all else is."""
    try:
        return read(source)
    except TokenizerError as exc:
        raise ModelFileError(f"{path}: {exc}") from None

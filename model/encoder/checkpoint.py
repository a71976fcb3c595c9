"""Reads an encoder embedding model from a directory as sentence-transformers packages it:
`config.json` + safetensors (the encoder), `tokenizer.json`, `modules.json` naming its
`Pooling` and `Normalize` stages, `1_Pooling/config.json` and `sentence_bert_config.json`
(the length it was trained to read).

A bare Hugging Face BERT directory (no `modules.json`) loads too, with the pooling
sentence-transformers gives such a model: mean, not normalised. A cross-encoder
(`BertForSequenceClassification`, as `CrossEncoder.save` writes it) loads with its
classifier head (model/encoder/classifier.py) and scores text pairs instead of embedding.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from model.checkpoint.safetensors import count_tensors, iter_safetensors, safetensors_files
from model.encoder.bert import Bert, BertConfig
from model.encoder.classifier import ClassifierHead, build_head, head_tensor_name, is_cross_encoder
from model.encoder.pooling import PoolingConfig
from model.encoder.precision import fastest_dtype
from model.errors import ModelFileError, UnsupportedModelError
from model.plan.weight_format import DTYPES
from model.text.wordpiece import WordPieceTokenizer

logger = logging.getLogger(__name__)

ENCODER_MODEL_TYPES = ("bert",)


@dataclass
class LoadedEncoder:
    name: str
    path: Path
    model: Bert
    tokenizer: WordPieceTokenizer
    pooling: PoolingConfig
    max_model_len: int
    # Lengths `dimensions` may cut a vector to: None when the model was not trained to
    # be cut (a request asking is a 400), "any" when its config allows every length.
    matryoshka: list[int] | str | None
    # A cross-encoder's pooler and classifier: set, the model scores pairs and embeds nothing.
    head: ClassifierHead | None = None

    @property
    def dim(self) -> int:
        return self.model.config.dim


def is_encoder_dir(path: Path) -> bool:
    config = path / "config.json"
    if not (path.is_dir() and config.is_file()):
        return False
    try:
        return _read_json(config).get("model_type") in ENCODER_MODEL_TYPES
    except ModelFileError:
        return False


def load_encoder(
    path: Path,
    dtype: torch.dtype | str = torch.float32,
    device: str = "cpu",
    max_model_len: int | None = None,
    progress: bool = True,
) -> LoadedEncoder:
    hf = _read_json(path / "config.json")
    config = BertConfig.from_hf(hf, str(path / "config.json"))
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelFileError(f"{path}: no tokenizer.json (an encoder needs its WordPiece file)")
    tokenizer = WordPieceTokenizer(tokenizer_file)
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelFileError(
            f"{tokenizer_file}: {tokenizer.vocab_size} tokens, but the model embeds only "
            f"{config.vocab_size}"
        )
    pooling, trained_len = _sentence_transformers_stages(path)
    if trained_len is None:
        trained_len = _tokenizer_max_length(path)
    limit = min(x for x in (config.max_position, trained_len, max_model_len) if x is not None)
    files = safetensors_files(path)
    model = Bert(config)
    head = build_head(path, hf, config.dim) if is_cross_encoder(hf) else None
    if head is not None:
        _check_pair_template(tokenizer, tokenizer_file, limit)
    _load_weights(model, head, files, progress, str(path))
    if head is not None:
        head = head.to(device=device).eval()
    model = model.to(device=device).eval()
    if dtype == "auto":
        model = fastest_dtype(model)
    else:
        model = model.to(DTYPES[dtype] if isinstance(dtype, str) else dtype)
    logger.info(
        "encoder %s: %d layers, dim %d, %s, up to %d tokens",
        path.name,
        config.n_layers,
        config.dim,
        f"cross-encoder, {head.activation} of one label"
        if head is not None
        else f"{pooling.mode} pooling{', normalised' if pooling.normalize else ''}",
        limit,
    )
    return LoadedEncoder(
        name=path.name,
        path=path,
        model=model,
        tokenizer=tokenizer,
        pooling=pooling,
        max_model_len=limit,
        matryoshka=matryoshka_dimensions(hf),
        head=head,
    )


def _check_pair_template(tokenizer: WordPieceTokenizer, file: Path, limit: int) -> None:
    """A tokenizer.json whose template has no pair form joins two texts with no [CLS] or
    [SEP] at all, silently; a cross-encoder was trained on the marked pair."""
    ids, _ = tokenizer.encode_pairs([("a", "b")], limit)[0]
    bare = tokenizer.encode("a", add_bos=False) + tokenizer.encode("b", add_bos=False)
    if len(ids) <= len(bare):
        raise ModelFileError(f"{file}: its post-processor has no template for text pairs")


def _load_weights(
    model: Bert, head: ClassifierHead | None, files: list[Path], progress: bool, source: str
) -> None:
    """One pass over the safetensors: the encoder's tensors to `model`, the pooler's and
    classifier's to `head` (dropped where there is none: an embedder has no use for them)."""
    head_tensors: dict[str, torch.Tensor] = {}

    def encoder_tensors(
        weights: Iterator[tuple[str, torch.Tensor]],
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            ours = head_tensor_name(name)
            if ours is None:
                yield name, tensor
            elif head is not None:
                head_tensors[ours] = tensor

    weights = encoder_tensors(iter_safetensors(files, torch.float32))
    total = count_tensors(files)
    model.load_weights(tqdm(weights, total=total, desc="loading weights", disable=not progress))
    if head is not None:
        head.load_weights(head_tensors, source)


def matryoshka_dimensions(hf: dict[str, Any]) -> list[int] | str | None:
    """vLLM's config fields for models trained so a vector's first k entries embed too."""
    dims = hf.get("matryoshka_dimensions")
    if isinstance(dims, list) and all(isinstance(d, int) for d in dims):
        return sorted(dims)
    return "any" if hf.get("is_matryoshka") is True else None


def _tokenizer_max_length(path: Path) -> int | None:
    """`model_max_length` of `tokenizer_config.json`, which sentence-transformers reads
    where `sentence_bert_config.json` names no length (as `CrossEncoder.save` writes it)."""
    file = path / "tokenizer_config.json"
    if not file.is_file():
        return None
    value = _read_json(file).get("model_max_length")
    return value if isinstance(value, int) and value > 0 else None


def _sentence_transformers_stages(path: Path) -> tuple[PoolingConfig, int | None]:
    """The pooling the package declares and the length it reads (None: not said)."""
    trained_len = None
    st_config = path / "sentence_bert_config.json"
    if st_config.is_file():
        value = _read_json(st_config).get("max_seq_length")
        trained_len = int(value) if isinstance(value, int) else None
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return PoolingConfig(mode="mean", normalize=False), trained_len
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ModelFileError(f"{modules_file}: expected a list of modules")
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    unknown = set(kinds) - {"Transformer", "Pooling", "Normalize"}
    if unknown:
        raise UnsupportedModelError(
            f"{modules_file}: sentence-transformers stage {sorted(unknown)[0]} is not supported "
            "(only Transformer, Pooling and Normalize)"
        )
    mode = "mean"
    if "Pooling" in kinds:
        pooling_file = path / str(kinds["Pooling"].get("path", "")) / "config.json"
        mode = _pooling_mode(_read_json(pooling_file), pooling_file)
    return PoolingConfig(mode=mode, normalize="Normalize" in kinds), trained_len


def _pooling_mode(fields: dict[str, Any], source: Path) -> str:
    if "pooling_mode" in fields:  # newer sentence-transformers write the name
        named = {"mean": "mean", "cls": "cls", "lasttoken": "last"}.get(fields["pooling_mode"])
        if named is None:
            raise UnsupportedModelError(f"{source}: pooling {fields['pooling_mode']!r}")
        return named
    chosen = [k for k, v in fields.items() if k.startswith("pooling_mode_") and v is True]
    modes = {
        "pooling_mode_mean_tokens": "mean",
        "pooling_mode_cls_token": "cls",
        "pooling_mode_lasttoken": "last",
    }
    if len(chosen) != 1 or chosen[0] not in modes:
        raise UnsupportedModelError(
            f"{source}: pooling {', '.join(chosen) or 'none'} is not supported "
            "(one of mean, cls, lasttoken)"
        )
    return modes[chosen[0]]


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise ModelFileError(f"{file}: missing") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelFileError(f"{file}: not readable JSON ({exc})") from None

"""Reading a tokenizer out of a checkpoint: GGUF metadata or an HF `tokenizer.json`
directory, into the vocabulary, merges, specials and pre-tokenizer a `Tokenizer` is built from.

Owns the translation of each file format's fields; refuses shapes it cannot reproduce
exactly (a `TokenizerError` naming the field) rather than tokenizing slightly wrong.
"""

import json
import logging
from pathlib import Path
from typing import Any

from model.errors import TokenizerError
from model.text.pretokenizer import GPT2_PATTERN, PATTERN_BY_GGUF_PRE, pattern_from_hf
from model.text.spm_tokenizer import BYTE as SPM_BYTE
from model.text.spm_tokenizer import BYTE_TOKEN as SPM_BYTE_TOKEN
from model.text.spm_tokenizer import NORMAL as SPM_NORMAL
from model.text.spm_tokenizer import SpmTokenizer
from model.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_GGUF_CONTROL, _GGUF_USER_DEFINED, _GGUF_UNKNOWN, _GGUF_UNUSED = 3, 4, 2, 5


def _read_json(path: Path) -> dict[str, Any]:
    """A missing optional file reads as {}; an unreadable one is an error naming the file."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path} cannot be read: {exc}") from None


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores a special token as a string or as a serialized AddedToken."""
    return value.get("content") if isinstance(value, dict) else value


def tokenizer_from_gguf(metadata: dict[str, Any]) -> Tokenizer:
    """From GGUF metadata, by `tokenizer.ggml.model`: byte-level BPE ("gpt2": vocab, token
    types, merges and the `tokenizer.ggml.pre` name) or SentencePiece BPE ("llama": vocab,
    scores and token types)."""
    model = metadata.get("tokenizer.ggml.model")
    if model == "llama":
        return _spm_from_gguf(metadata)
    if model != "gpt2":
        raise TokenizerError(
            f"tokenizer.ggml.model is {model!r}; supported are 'gpt2' (byte-level BPE) "
            "and 'llama' (SentencePiece BPE)"
        )
    pre = metadata.get("tokenizer.ggml.pre")
    if pre is None:
        log.warning("GGUF has no tokenizer.ggml.pre; using the GPT-2 pre-tokenizer")
    elif pre not in PATTERN_BY_GGUF_PRE:
        raise TokenizerError(f"tokenizer.ggml.pre {pre!r} is not a known pre-tokenizer")
    tokens = metadata["tokenizer.ggml.tokens"]
    types = metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))
    special_types = (_GGUF_CONTROL, _GGUF_UNKNOWN, _GGUF_UNUSED)
    added = {
        i: t in special_types
        for i, t in enumerate(types)
        if t in (*special_types, _GGUF_USER_DEFINED)
    }
    merges = [tuple(merge.split(" ")) for merge in metadata.get("tokenizer.ggml.merges", [])]
    eos_id, extra_stops = _gguf_stop_ids(metadata)
    return Tokenizer(
        tokens=tokens,
        merges=merges,
        added=added,
        pattern=PATTERN_BY_GGUF_PRE.get(pre or "gpt-2", GPT2_PATTERN),
        eos_id=eos_id,
        bos_id=metadata.get("tokenizer.ggml.bos_token_id"),
        pad_id=metadata.get("tokenizer.ggml.padding_token_id"),
        add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        extra_stop_ids=extra_stops,
    )


def _gguf_stop_ids(metadata: dict[str, Any]) -> tuple[int, list[int]]:
    """The eos id (required) and the other end-of-turn ids the file names."""
    if "tokenizer.ggml.eos_token_id" not in metadata:
        raise TokenizerError("GGUF has no tokenizer.ggml.eos_token_id")
    extra_stops = [
        metadata[key]
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if key in metadata
    ]
    return metadata["tokenizer.ggml.eos_token_id"], extra_stops


def _spm_from_gguf(metadata: dict[str, Any]) -> SpmTokenizer:
    """SentencePiece: the merge order comes from the scores, so they must be there. BOS and
    the space prefix default to on, as llama.cpp defaults them for this model (Llama 2's
    files predate the flags); Gemma's files turn the prefix off."""
    tokens = metadata["tokenizer.ggml.tokens"]
    if "tokenizer.ggml.scores" not in metadata:
        raise TokenizerError("GGUF SentencePiece vocabulary has no tokenizer.ggml.scores")
    eos_id, extra_stops = _gguf_stop_ids(metadata)
    return SpmTokenizer(
        tokens=tokens,
        scores=metadata["tokenizer.ggml.scores"],
        types=metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)),
        eos_id=eos_id,
        bos_id=metadata.get("tokenizer.ggml.bos_token_id"),
        pad_id=metadata.get("tokenizer.ggml.padding_token_id"),
        add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", True)),
        add_space_prefix=bool(metadata.get("tokenizer.ggml.add_space_prefix", True)),
        extra_stop_ids=extra_stops,
    )


def tokenizer_from_hf_dir(path: str | Path) -> Tokenizer:
    """From `tokenizer.json`, `tokenizer_config.json` and `generation_config.json`: a
    byte-level BPE, or a SentencePiece BPE with byte fallback (Gemma, Mistral, Llama 2)."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise TokenizerError(f"{path} has no tokenizer.json")
    spec = _read_json(path / "tokenizer.json")
    config = _read_json(path / "tokenizer_config.json")
    bpe = spec.get("model", {})
    affixes = bpe.get("continuing_subword_prefix") or bpe.get("end_of_word_suffix")
    if bpe.get("type") != "BPE" or affixes:
        raise TokenizerError(f"{path}/tokenizer.json model is not a BPE")

    id_of: dict[str, int] = dict(bpe.get("vocab", {}))
    added = {}
    for token in spec.get("added_tokens", []):
        id_of[token["content"]] = token["id"]
        added[token["id"]] = bool(token.get("special"))
    tokens = [""] * (max(id_of.values()) + 1)
    for text, token_id in id_of.items():
        tokens[token_id] = text
    merges = [
        tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in bpe.get("merges", [])
    ]

    def token_id(field: str) -> int | None:
        text = _token_content(config.get(field))
        if text is not None and text not in id_of:
            raise TokenizerError(f"tokenizer_config.json {field} {text!r} is not in the vocab")
        return None if text is None else id_of[text]

    eos_id = token_id("eos_token")
    if eos_id is None:
        raise TokenizerError(f"{path}/tokenizer_config.json has no eos_token")
    bos_id = token_id("bos_token")
    # The post-processor is what actually prepends BOS; the config flag is a fallback.
    post = spec.get("post_processor") or {}
    processors = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    templates = [p for p in processors if p.get("type") == "TemplateProcessing"]
    if templates:
        first = templates[0].get("single", [{}])[0]
        first_special = first.get("SpecialToken", {}).get("id")
        add_bos = bos_id is not None and id_of.get(first_special) == bos_id
    else:
        add_bos = bool(config.get("add_bos_token", False)) and bos_id is not None
    # Instruct checkpoints list their other end-of-turn ids here (Llama 3: <|eot_id|> ...).
    eos_ids = _read_json(path / "generation_config.json").get("eos_token_id") or []
    extra_stops = eos_ids if isinstance(eos_ids, list) else [eos_ids]

    if bpe.get("byte_fallback"):
        return SpmTokenizer(
            tokens=tokens,
            scores=_scores_from_merges(tokens, merges),
            types=_spm_types(tokens, added, bpe.get("unk_token")),
            eos_id=eos_id,
            bos_id=bos_id,
            pad_id=token_id("pad_token"),
            add_bos=add_bos,
            add_space_prefix=_spm_space_prefix(path, spec),
            extra_stop_ids=extra_stops,
        )
    normalizer = spec.get("normalizer")
    if normalizer not in (None, {"type": "NFC"}):
        raise TokenizerError(f"unsupported normalizer {json.dumps(normalizer)}")
    return Tokenizer(
        tokens=tokens,
        merges=merges,
        added=added,
        pattern=pattern_from_hf(spec.get("pre_tokenizer")),
        eos_id=eos_id,
        bos_id=bos_id,
        pad_id=token_id("pad_token"),
        add_bos=add_bos,
        extra_stop_ids=extra_stops,
        normalize_nfc=normalizer is not None,
    )


# SentencePiece BPE as `tokenizers` stores it: the merges in order, where SentencePiece has
# a score per piece. Merging always the best-ranked pair (HF) and always the best-scoring
# merged piece (SentencePiece, model/text/spm_tokenizer.py) agree when a piece's score is
# the rank of its first merge, negated: the converters write merges in score order.
_SPACE = "\u2581"
_REPLACE_SPACES = {"type": "Replace", "pattern": {"String": " "}, "content": _SPACE}
_PREPEND_SPACE = {"type": "Prepend", "prepend": _SPACE}


def _scores_from_merges(tokens: list[str], merges: list[tuple[str, ...]]) -> list[float]:
    first_rank: dict[str, int] = {}
    for rank, pair in enumerate(merges):
        first_rank.setdefault("".join(pair), rank)
    # Pieces no merge forms (single characters) are never a merge's result: any score.
    return [-float(first_rank.get(text, len(merges))) for text in tokens]


def _spm_types(tokens: list[str], added: dict[int, bool], unk: str | None) -> list[int]:
    types = []
    for token_id, text in enumerate(tokens):
        if token_id in added:  # special: a control token; else matched in plain text
            types.append(_GGUF_CONTROL if added[token_id] else _GGUF_USER_DEFINED)
        elif text == unk:
            types.append(_GGUF_UNKNOWN)
        elif SPM_BYTE_TOKEN.fullmatch(text):
            types.append(SPM_BYTE)
        elif text:
            types.append(SPM_NORMAL)
        else:
            types.append(_GGUF_UNUSED)  # an id no token has
    return types


def _spm_space_prefix(path: Path, spec: dict[str, Any]) -> bool:
    """Spaces written as "▁", with one in front of the text (Llama 2, Mistral) or not
    (Gemma 3), by the normalizer or by a Metaspace pre-tokenizer; refused otherwise."""
    normalizer, pre = spec.get("normalizer"), spec.get("pre_tokenizer")
    steps = normalizer.get("normalizers", []) if normalizer else []
    if normalizer is not None and normalizer.get("type") != "Sequence":
        steps = [normalizer]
    # Gemma's: a split on spaces after they have all become "▁", which cuts nothing.
    inert_split = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious"}
    if steps in ([_REPLACE_SPACES], [_PREPEND_SPACE, _REPLACE_SPACES]) and (
        pre is None or {**pre, "invert": False} == {**inert_split, "invert": False}
    ):
        return steps[0] == _PREPEND_SPACE
    if normalizer is None and pre and pre.get("type") == "Metaspace":
        if pre.get("replacement") == _SPACE and pre.get("prepend_scheme") in ("always", "first"):
            return True
        if pre.get("replacement") == _SPACE and pre.get("prepend_scheme") == "never":
            return False
    raise TokenizerError(
        f"{path}/tokenizer.json: a SentencePiece BPE whose spaces are written by normalizer "
        f"{json.dumps(normalizer)} and pre-tokenizer {json.dumps(pre)} is not supported"
    )

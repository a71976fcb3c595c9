"""Byte-level BPE tokenization on `tiktoken`, built from GGUF metadata or a `tokenizer.json`.

Owns: text <-> token ids, special tokens and stop ids (pre-tokenizer regexes live in
pretokenizer.py, streaming detokenization in detokenizer.py). Must never guess: an unknown
pre-tokenizer, normalizer or vocabulary shape is refused with a `TokenizerError` rather than
tokenized slightly wrong, because a wrong split is silent (the model still answers, just
worse). Build once at start-up; encoding runs in tiktoken's native code.
"""

import json
import logging
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tiktoken

from model.pretokenizer import GPT2_PATTERN, PATTERN_BY_GGUF_PRE, TokenizerError, pattern_from_hf

log = logging.getLogger(__name__)

# Specials that end a turn or a document; generation stops on any of them, not only on eos.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>")
_GGUF_CONTROL, _GGUF_USER_DEFINED, _GGUF_UNKNOWN, _GGUF_UNUSED = 3, 4, 2, 5


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's `bytes_to_unicode`, inverted: printable bytes stand for themselves, the other 68
    bytes for the code points from U+0100 up, so every token is a printable string."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    char_of = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in char_of):
        char_of[b] = chr(256 + n)
    return {c: b for b, c in char_of.items()}


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


class Tokenizer:
    """Byte-level BPE. Ranks come from the merge list (merge k creates the token of rank 256 + k),
    so token ids need not be in merge order; a lookup table maps tiktoken's ranks back to ids."""

    def __init__(
        self,
        *,
        tokens: Sequence[str],
        merges: Sequence[tuple[str, str]],
        added: dict[int, bool],
        pattern: str,
        eos_id: int,
        bos_id: int | None = None,
        pad_id: int | None = None,
        add_bos: bool = False,
        extra_stop_ids: Sequence[int] = (),
        normalize_nfc: bool = False,
    ) -> None:
        """`tokens[id]` is the vocabulary in GPT-2 byte-to-unicode form; `added` maps the id of each
        added token (kept out of BPE, written as plain text) to whether it is special."""
        byte_of = _gpt2_byte_decoder()
        token_bytes: list[bytes] = []
        id_of: dict[bytes, int] = {}
        for token_id, text in enumerate(tokens):
            if token_id in added:
                token_bytes.append(text.encode("utf-8"))
                continue
            try:
                raw = bytes(byte_of[c] for c in text)
            except KeyError:
                raise TokenizerError(f"token {token_id} {text!r} is not byte-level BPE") from None
            token_bytes.append(raw)
            id_of.setdefault(raw, token_id)

        # tiktoken needs a rank for every byte; bytes without a token get one that maps to -1
        # and is dropped from the output, as HF and llama.cpp drop them.
        ranks = {bytes([b]): b for b in range(256)}
        rank_to_id = [id_of.get(bytes([b]), -1) for b in range(256)]
        for k, merge in enumerate(merges):
            try:
                left, right = (bytes(byte_of[c] for c in part) for part in merge)
            except (KeyError, ValueError):
                raise TokenizerError(f"merge {k} {merge!r} is not two byte-level tokens") from None
            merged = left + right
            if merged not in id_of or left not in id_of or right not in id_of:
                raise TokenizerError(f"merge {k} {merge!r} uses a token not in the vocabulary")
            if merged not in ranks:
                ranks[merged] = len(rank_to_id)
                rank_to_id.append(id_of[merged])
        self._build(token_bytes, ranks, rank_to_id, added, pattern, eos_id, bos_id, pad_id, add_bos)
        self._normalize_nfc = normalize_nfc
        self.stop_ids |= set(extra_stop_ids)

    @classmethod
    def from_ranks(
        cls,
        *,
        token_bytes: Sequence[bytes],
        ranks: dict[bytes, int],
        added: dict[int, bool],
        pattern: str,
        eos_id: int,
        bos_id: int | None = None,
        pad_id: int | None = None,
        add_bos: bool = False,
    ) -> "Tokenizer":
        """tiktoken's own vocabulary form, where a BPE token's id is its rank (`ranks` maps
        bytes to id). `token_bytes[id]` covers the whole vocabulary: BPE tokens, added tokens
        (as UTF-8 text) and ids that encoding never produces but a model may still emit."""
        missing = [b for b in range(256) if bytes([b]) not in ranks]
        if missing:
            raise TokenizerError(f"{len(missing)} byte values have no rank, e.g. {missing[:4]}")
        for token, token_id in ranks.items():
            if not 0 <= token_id < len(token_bytes) or token_bytes[token_id] != token:
                raise TokenizerError(f"rank {token_id} of {token!r} is not that token's id")
        tokenizer = cls.__new__(cls)
        rank_to_id = list(range(max(ranks.values()) + 1))
        tokenizer._build(
            list(token_bytes), ranks, rank_to_id, added, pattern, eos_id, bos_id, pad_id, add_bos
        )
        tokenizer._normalize_nfc = False
        return tokenizer

    def _build(
        self,
        token_bytes: list[bytes],
        ranks: dict[bytes, int],
        rank_to_id: list[int],
        added: dict[int, bool],
        pattern: str,
        eos_id: int,
        bos_id: int | None,
        pad_id: int | None,
        add_bos: bool,
    ) -> None:
        """The part every vocabulary form shares, once BPE ranks and their ids are known."""
        self.vocab_size = len(token_bytes)
        for name, token_id in (("eos", eos_id), ("bos", bos_id), ("pad", pad_id)):
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise TokenizerError(f"{name} id {token_id} is outside the vocabulary")
        self.eos_id, self.bos_id, self.pad_id, self.add_bos = eos_id, bos_id, pad_id, add_bos
        self._token_bytes = token_bytes
        self._has_missing_bytes = -1 in rank_to_id
        text_of = {i: token_bytes[i].decode("utf-8") for i in added}
        self.special_tokens = {text_of[i]: i for i, special in added.items() if special}
        # Non-special added tokens are always matched in text, as HF and llama.cpp match them.
        self._always_split = frozenset(text_of[i] for i, special in added.items() if not special)
        self._allow_all = self._always_split | frozenset(self.special_tokens)
        added_ranks = {}
        for token_id in sorted(added):
            added_ranks[text_of[token_id]] = len(rank_to_id)
            rank_to_id.append(token_id)
        self._rank_to_id = np.asarray(rank_to_id, dtype=np.int64)
        try:
            self._encoding = tiktoken.Encoding(
                "bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens=added_ranks
            )
        except ValueError as exc:
            raise TokenizerError(
                f"pre-tokenizer regex {pattern!r} does not compile: {exc}"
            ) from None

        self._skip_ids = frozenset(self.special_tokens.values())
        self.stop_ids = {eos_id}
        self.stop_ids |= {
            self.special_tokens[t] for t in _END_OF_TURN_TOKENS if t in self.special_tokens
        }

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> "Tokenizer":
        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise TokenizerError(f"tokenizer.ggml.model is {model!r}; only byte-level BPE 'gpt2'")
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
        if "tokenizer.ggml.eos_token_id" not in metadata:
            raise TokenizerError("GGUF has no tokenizer.ggml.eos_token_id")
        extra_stops = [
            metadata[key]
            for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
            if key in metadata
        ]
        return cls(
            tokens=tokens,
            merges=merges,
            added=added,
            pattern=PATTERN_BY_GGUF_PRE.get(pre or "gpt-2", GPT2_PATTERN),
            eos_id=metadata["tokenizer.ggml.eos_token_id"],
            bos_id=metadata.get("tokenizer.ggml.bos_token_id"),
            pad_id=metadata.get("tokenizer.ggml.padding_token_id"),
            add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
            extra_stop_ids=extra_stops,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise TokenizerError(f"{path} has no tokenizer.json")
        spec = _read_json(path / "tokenizer.json")
        config = _read_json(path / "tokenizer_config.json")
        bpe = spec.get("model", {})
        affixes = bpe.get("continuing_subword_prefix") or bpe.get("end_of_word_suffix")
        if bpe.get("type") != "BPE" or bpe.get("byte_fallback") or affixes:
            raise TokenizerError(f"{path}/tokenizer.json model is not a byte-level BPE")
        normalizer = spec.get("normalizer")
        if normalizer not in (None, {"type": "NFC"}):
            raise TokenizerError(f"unsupported normalizer {json.dumps(normalizer)}")
        pattern = pattern_from_hf(spec.get("pre_tokenizer"))

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
        return cls(
            tokens=tokens,
            merges=merges,
            added=added,
            pattern=pattern,
            eos_id=eos_id,
            bos_id=bos_id,
            pad_id=token_id("pad_token"),
            add_bos=add_bos,
            extra_stop_ids=eos_ids if isinstance(eos_ids, list) else [eos_ids],
            normalize_nfc=normalizer is not None,
        )

    def encode(
        self, text: str, allow_special: bool = False, add_bos: bool | None = None
    ) -> list[int]:
        """Special-token text is a special token only with `allow_special`; otherwise it is
        tokenized as the plain text it is, so user input can never inject a control token."""
        if self._normalize_nfc:
            text = unicodedata.normalize("NFC", text)
        allowed = self._allow_all if allow_special else self._always_split
        try:
            ranks = self._encoding.encode_to_numpy(
                text, allowed_special=allowed, disallowed_special=()
            )
        except UnicodeEncodeError:
            # Lone surrogates (legal in JSON strings) have no UTF-8 form: they become U+FFFD,
            # as in tiktoken's own encode().
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            return self.encode(text, allow_special, add_bos)
        ids = self._rank_to_id[ranks]
        if self._has_missing_bytes:
            ids = ids[ids >= 0]
        with_bos = self.add_bos if add_bos is None else add_bos
        prefix = [self.bos_id] if with_bos and self.bos_id is not None else []
        return prefix + ids.tolist()

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary")
        return self._token_bytes[token_id]

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        if skip_special:
            ids = [i for i in ids if i not in self._skip_ids]
        if ids and not 0 <= min(ids) <= max(ids) < self.vocab_size:
            raise TokenizerError(f"decode got a token id outside the vocabulary: {list(ids)}")
        return b"".join([self._token_bytes[i] for i in ids]).decode("utf-8", errors="replace")

    def is_special(self, token_id: int) -> bool:
        return token_id in self._skip_ids

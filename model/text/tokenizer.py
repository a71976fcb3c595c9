"""Byte-level BPE tokenization on `tiktoken`, built from the vocabulary a
checkpoint holds (read by tokenizer_files.py).

Owns: text <-> token ids, special tokens and stop ids (pre-tokenizer regexes live in
pretokenizer.py, streaming detokenization in detokenizer.py). Must never guess: an unknown
pre-tokenizer, normalizer or vocabulary shape is refused with a `TokenizerError` rather than
tokenized slightly wrong, because a wrong split is silent (the model still answers, just
worse). Build once at start-up; encoding runs in tiktoken's native code.
"""

import logging
import unicodedata
from collections.abc import Sequence

import numpy as np
import tiktoken

from model.errors import TokenizerError

log = logging.getLogger(__name__)

# Specials that end a turn or a document; generation stops on any of them, not only on eos.
_END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<end_of_turn>",  # Gemma
    # gpt-oss (harmony): the answer is done, or a tool call waits for its result. Its
    # `<|end|>` only ends one message of the answer (as llama.cpp also sees it).
    "<|return|>",
    "<|call|>",
)


def _gpt2_byte_table() -> dict[int, str]:
    """GPT-2's `bytes_to_unicode`, inverted, as a `str.translate` table: printable bytes
    stand for themselves, the other 68 bytes for the code points from U+0100 up, so every
    token is a printable string. Each of those characters becomes the one of its byte's
    code point, so that encoding the result to Latin-1 gives the token's bytes; the
    characters no byte stands for become U+FFFF, which Latin-1 refuses, as it does every
    character past the table (one pass per token: Qwen2.5's tokenizer builds in 0.51 s
    instead of 0.68)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    char_of = {b: b for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in char_of):
        char_of[b] = 256 + n
    table = dict.fromkeys(range(max(char_of.values()) + 1), "\uffff")
    table.update({c: chr(b) for b, c in char_of.items()})
    return table


_GPT2_BYTES = _gpt2_byte_table()


def _gpt2_bytes(text: str) -> bytes:
    """A token in GPT-2's byte-to-unicode form -> its bytes; UnicodeEncodeError (a
    ValueError) where a character stands for no byte."""
    return text.translate(_GPT2_BYTES).encode("latin-1")


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
        token_bytes: list[bytes] = []
        id_of: dict[bytes, int] = {}
        for token_id, text in enumerate(tokens):
            if token_id in added:
                token_bytes.append(text.encode("utf-8"))
                continue
            try:
                raw = _gpt2_bytes(text)
            except ValueError:
                raise TokenizerError(f"token {token_id} {text!r} is not byte-level BPE") from None
            token_bytes.append(raw)
            id_of.setdefault(raw, token_id)

        # tiktoken needs a rank for every byte; bytes without a token get one that maps to -1
        # and is dropped from the output, as HF and llama.cpp drop them.
        ranks = {bytes([b]): b for b in range(256)}
        rank_to_id = [id_of.get(bytes([b]), -1) for b in range(256)]
        for k, merge in enumerate(merges):
            try:
                left, right = (_gpt2_bytes(part) for part in merge)
            except ValueError:
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
        self._keep_harmony_going()

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
        self._init_vocabulary(token_bytes, added, eos_id, bos_id, pad_id, add_bos)
        self._has_missing_bytes = -1 in rank_to_id
        added_ranks = {}
        for token_id in sorted(added):
            added_ranks[token_bytes[token_id].decode("utf-8")] = len(rank_to_id)
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

    def _init_vocabulary(
        self,
        token_bytes: list[bytes],
        added: dict[int, bool],
        eos_id: int,
        bos_id: int | None,
        pad_id: int | None,
        add_bos: bool,
    ) -> None:
        """What any tokenizer here has once each id's bytes and the added tokens are known
        (shared with the SentencePiece tokenizer): the special ids, the added-token texts
        matched whole in text, and the stop ids."""
        self.vocab_size = len(token_bytes)
        for name, token_id in (("eos", eos_id), ("bos", bos_id), ("pad", pad_id)):
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise TokenizerError(f"{name} id {token_id} is outside the vocabulary")
        self.eos_id, self.bos_id, self.pad_id, self.add_bos = eos_id, bos_id, pad_id, add_bos
        self._token_bytes = token_bytes
        text_of = {i: token_bytes[i].decode("utf-8") for i in added}
        self.special_tokens = {text_of[i]: i for i, special in added.items() if special}
        # Non-special added tokens are always matched in text, as HF and llama.cpp match them.
        self._always_split = frozenset(text_of[i] for i, special in added.items() if not special)
        self._allow_all = self._always_split | frozenset(self.special_tokens)
        self._skip_ids = frozenset(self.special_tokens.values())
        self.stop_ids = {eos_id}
        self.stop_ids |= {
            self.special_tokens[t] for t in _END_OF_TURN_TOKENS if t in self.special_tokens
        }
        self._keep_harmony_going()

    def _keep_harmony_going(self) -> None:
        """A file may name harmony's `<|end|>` as end of turn; generation goes on past it."""
        if {"<|return|>", "<|call|>", "<|end|>"} <= self.special_tokens.keys():
            self.stop_ids.discard(self.special_tokens["<|end|>"])

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

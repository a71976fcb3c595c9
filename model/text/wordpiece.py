"""`WordPieceTokenizer`: the tokenizer of BERT-style encoders, read from a `tokenizer.json`
by Hugging Face's `tokenizers` library.

WordPiece's normalisation (lower-casing, accent stripping, CJK splitting) and its
[CLS]/[SEP] template live in that file and that library; reproducing them would be a
second implementation to keep in step. Our own BPE stays where it was measured faster:
this one only serves encoders, whose inputs are read once and never streamed back.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from model.errors import TokenizerError


class WordPieceTokenizer:
    """Enough of `Tokenizer`'s surface for the routes that serve an encoder: encode with
    the model's template, decode, the vocabulary size. An encoder generates nothing, so it
    has no stop tokens."""

    bos_id: int | None = None
    eos_id: int | None = None
    stop_ids: frozenset[int] = frozenset()

    def __init__(self, path: Path) -> None:
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises its own exception types
            raise TokenizerError(f"{path}: not a tokenizer.json ({exc})") from None
        # The file may ask for fixed-length padding and truncation (sentence-transformers'
        # own batching); lengths are the server's business: it refuses or truncates.
        self._tok.no_padding()
        self._tok.no_truncation()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_tokens = {
            t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        }

    def encode(
        self, text: str, allow_special: bool = False, add_bos: bool | None = None
    ) -> list[int]:
        """With the model's template ([CLS] text [SEP]) unless `add_bos` is False.
        Special-token text in `text` is the token it spells whatever `allow_special` says:
        the library matches it always, and so does sentence-transformers, whose vectors an
        encoder's must equal. An encoder only embeds: no control token steers anything."""
        return self._tok.encode(text, add_special_tokens=add_bos is not False).ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        if ids and not 0 <= min(ids) <= max(ids) < self.vocab_size:
            raise TokenizerError(f"decode got a token id outside the vocabulary: {list(ids)}")
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        return (self._tok.id_to_token(token_id) or "").encode()

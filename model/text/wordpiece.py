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
        # A second copy for text pairs, which a cross-encoder reads cut to its length as
        # sentence-transformers cuts them: the library's own longest-first truncation.
        self._pairs = HFTokenizer.from_str(self._tok.to_str())
        self._pairs_limit = 0

    def encode(
        self, text: str, allow_special: bool = False, add_bos: bool | None = None
    ) -> list[int]:
        """With the model's template ([CLS] text [SEP]) unless `add_bos` is False.
        Special-token text in `text` is the token it spells whatever `allow_special` says:
        the library matches it always, and so does sentence-transformers, whose vectors an
        encoder's must equal. An encoder only embeds: no control token steers anything."""
        try:
            return self._tok.encode(text, add_special_tokens=add_bos is not False).ids
        except TypeError:  # a lone surrogate: see _without_surrogates
            return self.encode(_without_surrogates(text), allow_special, add_bos)

    def encode_pairs(
        self, pairs: Sequence[tuple[str, str]], max_len: int
    ) -> list[tuple[list[int], list[int]]]:
        """(token ids, token type ids) of each pair in the model's pair template
        ([CLS] first [SEP] second [SEP], types 0 then 1), cut to `max_len` tokens by
        removing tokens from the longer text first, as `CrossEncoder.predict` does."""
        if max_len != self._pairs_limit:
            self._pairs.enable_truncation(max_len, strategy="longest_first")
            self._pairs_limit = max_len
        try:
            encoded = self._pairs.encode_batch(list(pairs))
        except TypeError:  # a lone surrogate: see _without_surrogates
            clean = [(_without_surrogates(a), _without_surrogates(b)) for a, b in pairs]
            encoded = self._pairs.encode_batch(clean)
        return [(e.ids, e.type_ids) for e in encoded]

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        if ids and not 0 <= min(ids) <= max(ids) < self.vocab_size:
            raise TokenizerError(f"decode got a token id outside the vocabulary: {list(ids)}")
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        return (self._tok.id_to_token(token_id) or "").encode()


def _without_surrogates(text: str) -> str:
    """Lone surrogates (legal in JSON strings) have no UTF-8 form, and the library refuses
    such a string: they become U+FFFD, as the BPE tokenizer makes them."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")

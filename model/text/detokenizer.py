"""Streaming detokenization: generated token ids to text as they arrive, never emitting
half a UTF-8 character. Must never change what the full decode would say."""

import codecs
from collections.abc import Sequence

from model.text.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns generated token ids into text as they arrive. A character whose UTF-8 bytes span
    several tokens (an emoji is often three) is held back until complete, so a stream never shows
    a replacement character that the final text does not have. Concatenating every `add()` and
    the final `flush()` gives exactly `tokenizer.decode(ids)`."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special: bool = False
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # A character that starts in the prompt and ends in the output is emitted whole. Its
        # start is at most 3 bytes, hence within the last 3 tokens; their text is discarded.
        for token_id in prompt_ids[-3:]:
            self._utf8.decode(tokenizer.token_bytes(token_id))

    def add(self, token_id: int) -> str:
        if self._skip_special and self._tokenizer.is_special(token_id):
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """Ends the stream: bytes of an unfinished character come out as U+FFFD."""
        return self._utf8.decode(b"", final=True)

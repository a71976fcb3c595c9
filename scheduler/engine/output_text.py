"""A request's generated text: incremental detokenization, stop strings that may span
tokens, and holding back text that could still turn out to be the start of a stop
string, so that a stop string is never sent, not even in part.
"""

from __future__ import annotations

from model.text.detokenizer import IncrementalDetokenizer
from model.text.tokenizer import Tokenizer


class OutputText:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        stop: list[str],
        skip_special: bool = True,
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special=skip_special)
        self._stop = stop
        self._max_stop = max((len(s) for s in stop), default=0)
        self.text = ""
        self._sent = 0
        self.stopped = False

    def add(self, token_id: int, check_stop: bool = True) -> bool:
        """Appends a token's text; True when a stop string now appears (the text is cut
        just before it)."""
        before = len(self.text)
        self.text += self._detok.add(token_id)
        if check_stop and self._stop:
            # A new match must end inside the new text, so search only from where a stop
            # string reaching into it could begin.
            start = max(0, before - self._max_stop + 1)
            hits = [i for s in self._stop if (i := self.text.find(s, start)) != -1]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
        return self.stopped

    def finish(self) -> None:
        if not self.stopped:
            self.text += self._detok.flush()

    def take(self, final: bool) -> str:
        """Text not sent yet; unless final, minus a tail that may begin a stop string."""
        end = len(self.text)
        if not final and not self.stopped:
            end -= self._held_back()
        new = self.text[self._sent : end]
        self._sent = max(self._sent, end)
        return new

    def _held_back(self) -> int:
        for n in range(min(self._max_stop - 1, len(self.text) - self._sent), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0

"""The boundary between a chat template's markup and the client's text in a rendered prompt.

Owns encoding a rendered chat prompt so that control tokens come only from the template: its
literals (role headers, BOS, separators, the generation prompt) become control tokens, while every
string the client sent (message content and text parts, names, tool calls and results, template
variables) stays plain text even where it spells a special token. Must never let client text
become a control token, and must never change the ids of a prompt whose client text spells no
special token: such a prompt is encoded as one string with special tokens allowed, as always.

Two renders find the client's text. In the first, each client string's special-token text is
swapped for a private-use placeholder, so the template only ever sees ordinary text (this survives
`trim`, `split`, `tojson` and comparisons); placeholders are turned back into plain text after.
The second also wraps each client string between two sentinels; where the template passed them
through untouched they say exactly where client text lies, which also catches a special token
spelled across two client strings or across client text and a template literal. The price:
a template that measures or compares client text that spells a special token sees one
placeholder character in its place.
"""

import re
from bisect import bisect_left
from collections.abc import Callable, Iterator
from functools import lru_cache
from itertools import chain
from typing import Any

from model.text.tokenizer import Tokenizer

# (messages, template variables) -> rendered prompt text.
Render = Callable[[list[dict[str, Any]], dict[str, Any]], str]
Span = tuple[int, int]

# Values templates compare with fixed words (`message.role == 'user'`, `part.type == 'text'`).
# Sentinels around them would only send the template down another branch, so they are never
# wrapped; their special-token text is still swapped for placeholders.
_COMPARED_KEYS = frozenset({"role", "type"})
_PRIVATE_USE = (range(0xE000, 0xF900), range(0xF0000, 0xFFFFE), range(0x100000, 0x10FFFE))


@lru_cache(maxsize=8)
def _special_pattern(specials: tuple[str, ...]) -> re.Pattern[str]:
    # Longest first: at one position the longest special wins, as in HF's added-token trie.
    return re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


def _map_strings(
    value: Any, fn: Callable[[str, Any], str], rename: Callable[[str], str], key: Any = None
) -> Any:
    """A copy of `value` with `fn(string, the key it is stored under)` applied to each string
    and `rename` to each dict key."""
    if isinstance(value, str):
        return fn(value, key)
    if isinstance(value, dict):
        return {
            (rename(k) if isinstance(k, str) else k): _map_strings(v, fn, rename, k)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_map_strings(item, fn, rename, key) for item in value]
    return value


class _Markers:
    """Private-use characters found nowhere in the client's strings, the special tokens or the
    template source, so each one in the rendered text can only be one we put there."""

    def __init__(self, used: set[str], pattern: re.Pattern[str]) -> None:
        self._free = (c for c in map(chr, chain(*_PRIVATE_USE)) if c not in used)
        self.open, self.close = next(self._free), next(self._free)
        self._pattern = pattern
        self._placeholder_of: dict[str, str] = {}  # special-token text -> its placeholder
        self.special_of: dict[str, str] = {}  # placeholder -> the special-token text it hides

    def hide_specials(self, text: str, _key: Any = None) -> str:
        return self._pattern.sub(lambda m: self._placeholder(m.group()), text)

    def hide_and_wrap(self, text: str, key: Any) -> str:
        return self._wrap(self.hide_specials(text), key)

    def _placeholder(self, special: str) -> str:
        if special not in self._placeholder_of:
            placeholder = next(self._free)
            self._placeholder_of[special], self.special_of[placeholder] = placeholder, special
        return self._placeholder_of[special]

    def _wrap(self, text: str, key: Any) -> str:
        """Surrounding whitespace stays outside the sentinels, so `trim` and `strip()` still
        see it and still remove it; an all-whitespace or empty string is left unwrapped, so
        templates that test a string's truthiness after trimming take the same branch."""
        core = text.strip()
        if not core or key in _COMPARED_KEYS:
            return text
        lead = text[: len(text) - len(text.lstrip())]
        return f"{lead}{self.open}{core}{self.close}{text[len(lead) + len(core) :]}"

    def spans(self, marked: str, plain: str) -> list[Span] | None:
        """Where the wrapped strings lie in `plain`, or None when the template changed them
        (sliced, split, measured, escaped): then the sentinels say nothing reliable."""
        spans: list[Span] = []
        length, start, parts = 0, None, []
        for piece in re.split(f"([{re.escape(self.open + self.close)}])", marked):
            if piece == self.open:
                if start is not None:
                    return None
                start = length
            elif piece == self.close:
                if start is None:
                    return None
                spans.append((start, length))
                start = None
            else:
                parts.append(piece)
                length += len(piece)
        return spans if start is None and "".join(parts) == plain else None


def _overlaps(start: int, end: int, spans: list[Span], span_starts: list[int]) -> bool:
    # Spans are disjoint and in order: the last one starting before `end` reaches furthest.
    i = bisect_left(span_starts, end) - 1
    return i >= 0 and spans[i][1] > start


def _special_text_in_spans(
    text: str, spans: list[Span], pattern: re.Pattern[str], longest: int
) -> bool:
    """Whether any special-token text, at any position and however the tokenizer resolves
    overlapping matches, touches client text."""
    for start, end in spans:
        pos = max(0, start - longest + 1)
        while (m := pattern.search(text, pos, end + longest - 1)) and m.start() < end:
            if m.end() > start:
                return True
            pos = m.start() + 1
    return False


def chat_prompt_ids(
    render: Render,
    messages: list[dict[str, Any]],
    variables: dict[str, Any],
    tokenizer: Tokenizer,
    template_source: str,
) -> list[int]:
    """The rendered prompt as ids, control tokens only where the template wrote them. Every
    template variable is the client's: the server fills them from `chat_template_kwargs`."""
    specials = tokenizer.special_tokens
    if not specials:
        return tokenizer.encode(render(messages, variables), allow_special=True, add_bos=False)
    pattern = _special_pattern(tuple(specials))
    used = set(template_source).union(*specials, *_strings([messages, variables]))
    markers = _Markers(used, pattern)

    def render_mapped(fn: Callable[[str, Any], str]) -> str:
        # Dict keys are never wrapped (templates look values up by them), only their special
        # text hidden. Variable names are the template's identifiers and stay as they are.
        hide = markers.hide_specials
        mapped = {name: _map_strings(v, fn, hide) for name, v in variables.items()}
        return render(_map_strings(messages, fn, hide), mapped)

    text = render_mapped(markers.hide_specials)
    try:
        spans = markers.spans(render_mapped(markers.hide_and_wrap), text) or []
    except ValueError:
        # The template refused the wrapped strings (a check on their length or first
        # character); the placeholders alone still keep their special-token text plain.
        spans = []

    longest = max(map(len, specials))
    if not markers.special_of and not _special_text_in_spans(text, spans, pattern, longest):
        return tokenizer.encode(text, allow_special=True, add_bos=False)

    def plain_ids(run: str) -> list[int]:
        for placeholder, special in markers.special_of.items():
            run = run.replace(placeholder, special)
        return tokenizer.encode(run, add_bos=False)

    # tiktoken splits text at the special tokens it may use and encodes the runs between them
    # on their own; this is the same, with only the template's special tokens as split points.
    span_starts = [start for start, _ in spans]
    ids: list[int] = []
    pos = 0
    for m in pattern.finditer(text):
        if _overlaps(m.start(), m.end(), spans, span_starts):
            continue  # client text: stays in the plain-text run around it
        ids += plain_ids(text[pos : m.start()])
        ids.append(specials[m.group()])
        pos = m.end()
    return ids + plain_ids(text[pos:])

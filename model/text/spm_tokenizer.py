"""SentencePiece BPE with byte fallback, as GGUF files whose `tokenizer.ggml.model` is "llama"
describe it (Gemma 3, Mistral's and Llama 2's own GGUFs): a vocabulary of pieces with scores and
token types, no merge list. Read from the metadata by tokenizer_files.py.

Owns: text -> ids exactly as llama.cpp's `llm_tokenizer_spm` (and SentencePiece, whose BPE
encoder it copies) produce them; ids -> bytes through the shared `Tokenizer` code. Must never
guess: a vocabulary it cannot reproduce (a byte value without its `<0xAB>` token, a token type
it does not know) is refused with a `TokenizerError`. Plain Python, so the slow part is built
to stay small: text is cut where no piece can span, and each cut is merged once and cached.
"""

import heapq
import re
from collections.abc import Iterable, Sequence

from model.errors import TokenizerError
from model.text.tokenizer import Tokenizer

# GGUF token types (llama.cpp's `llama_token_type`).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # SentencePiece writes every space as "▁"
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# Runs longer than this are merged with a heap (O(n log n)); shorter ones by rescanning their
# pairs each step, which in Python is quicker for the few characters of a word.
_HEAP_FROM = 24
_CACHE_SIZE, _CACHED_UP_TO = 1 << 16, 64


def trie_pattern(texts: Iterable[str]) -> re.Pattern[str] | None:
    """One regex for any of `texts`, longest match first at each position (as SentencePiece's
    and HF's added-token matchers), built as a trie: Gemma has thousands of control tokens, and
    a plain alternation would try each of them at every character."""
    root: dict[str, dict] = {}
    for text in filter(None, texts):
        node = root
        for char in text:
            node = node.setdefault(char, {})
        node[""] = {}

    def alternation(node: dict[str, dict]) -> str:
        branches = [re.escape(char) + alternation(child) for char, child in node.items() if char]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        if "" not in node:
            return body
        return (body if len(branches) > 1 else f"(?:{body})") + "?"

    return re.compile(alternation(root)) if root else None


class SpmTokenizer(Tokenizer):
    """The same interface as `Tokenizer` (encode, decode, token_bytes, specials, stop ids), so
    nothing else needs to know which kind it has. Encoding, per llama.cpp's `tokenize` for SPM:
    added tokens are cut out first, whole (user-defined ones always, control ones only with
    `allow_special`); in each run between them spaces become "▁" (with one more in front when
    `add_space_prefix`), then characters are merged pairwise, always the pair whose merged
    string is the best-scoring NORMAL piece, leftmost on ties; a piece left without a token is
    written as its UTF-8 bytes, `<0xAB>` tokens.

    Where the references part ways, and which one this follows (none of it changes Gemma 3's
    ids except the first):
    - user-defined tokens are found in the raw text, as llama.cpp does, so a literal "▁" in the
      input is never part of one of Gemma's whitespace-run tokens; SentencePiece finds them
      after escaping, where "▁▁" and "  " look alike.
    - overlapping added tokens: leftmost, then longest, as SentencePiece and HF match them;
      llama.cpp takes the longest token first wherever it is. Only overlapping texts differ.
    - merges only form NORMAL pieces, as in SentencePiece; llama.cpp would also form a control
      or byte token's text from two pieces, if its vocabulary had such a pair (Gemma's has not).
    - with `add_space_prefix`, every run of text gets the "▁", also after a special token
      (llama.cpp); HF's Llama tokenizers prefix only the start of the text."""

    def __init__(
        self,
        *,
        tokens: Sequence[str],
        scores: Sequence[float],
        types: Sequence[int],
        eos_id: int,
        bos_id: int | None = None,
        pad_id: int | None = None,
        add_bos: bool = False,
        add_space_prefix: bool = True,
        extra_stop_ids: Sequence[int] = (),
    ) -> None:
        if not len(tokens) == len(scores) == len(types):
            raise TokenizerError(
                f"{len(tokens)} tokens but {len(scores)} scores and {len(types)} token types"
            )
        token_bytes: list[bytes] = []
        added: dict[int, bool] = {}
        self._piece_id: dict[str, int] = {}
        self._score: dict[str, float] = {}
        byte_ids: dict[int, int] = {}
        for token_id, (text, kind, score) in enumerate(zip(tokens, types, scores, strict=True)):
            if kind == NORMAL:
                token_bytes.append(text.replace(SPACE, " ").encode("utf-8"))
                if text not in self._piece_id:
                    self._piece_id[text] = token_id
                    self._score[text] = float(score)
            elif kind == BYTE:
                match = BYTE_TOKEN.fullmatch(text)
                if match is None:
                    raise TokenizerError(
                        f"byte token {token_id} {text!r} is not of the form <0xAB>"
                    )
                value = int(match.group(1), 16)
                byte_ids.setdefault(value, token_id)
                token_bytes.append(bytes([value]))
            elif kind in (UNKNOWN, CONTROL, USER_DEFINED, UNUSED):
                # Kept whole and written as the text they are; only user-defined ones are
                # matched in plain text (as llama.cpp, SentencePiece and HF all do).
                token_bytes.append(text.encode("utf-8"))
                added[token_id] = kind != USER_DEFINED
            else:
                raise TokenizerError(f"token {token_id} {text!r} has unknown token type {kind}")
        missing = [b for b in range(256) if b not in byte_ids]
        if missing:
            raise TokenizerError(
                f"{len(missing)} byte values have no <0xAB> token (e.g. {missing[0]:#04x}); "
                "only SentencePiece vocabularies with byte fallback are supported"
            )
        self._byte_ids = [byte_ids[b] for b in range(256)]
        if add_bos and bos_id is None:
            raise TokenizerError("the vocabulary adds BOS but has no bos token id")
        self._init_vocabulary(token_bytes, added, eos_id, bos_id, pad_id, add_bos)
        self.stop_ids |= set(extra_stop_ids)
        self.add_space_prefix = add_space_prefix
        self._added_id = {token_bytes[i].decode("utf-8"): i for i in sorted(added, reverse=True)}
        self._match_always = trie_pattern(self._always_split)
        self._match_allowed = trie_pattern(self._allow_all)
        self._cut = _cut_pattern(self._piece_id)
        self._cache: dict[str, list[int]] = {}

    def encode(
        self, text: str, allow_special: bool = False, add_bos: bool | None = None
    ) -> list[int]:
        """Special-token text is a special token only with `allow_special`; otherwise it is
        tokenized as the plain text it is, so user input can never inject a control token."""
        if not text.isascii():
            # Lone surrogates (legal in JSON strings) have no UTF-8 form: U+FFFD, as Tokenizer.
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        with_bos = self.add_bos if add_bos is None else add_bos
        ids = [self.bos_id] if with_bos and self.bos_id is not None else []
        matcher = self._match_allowed if allow_special else self._match_always
        start = 0
        for match in matcher.finditer(text) if matcher is not None else ():
            if match.start() > start:
                self._encode_run(text[start : match.start()], ids)
            ids.append(self._added_id[match.group()])
            start = match.end()
        if start < len(text):
            self._encode_run(text[start:], ids)
        return ids

    def _encode_run(self, text: str, out: list[int]) -> None:
        """Text between added tokens. llama.cpp prefixes every such run, not only the first,
        since each follows either the start or an added token."""
        if self.add_space_prefix:
            text = " " + text
        text = text.replace(" ", SPACE)
        cache = self._cache
        for part in self._cut.split(text):
            ids = cache.get(part)
            if ids is None:
                ids = self._merge(part)
                if len(part) <= _CACHED_UP_TO:  # words repeat; long parts would only use memory
                    if len(cache) >= _CACHE_SIZE:
                        cache.clear()
                    cache[part] = ids
            out += ids

    def _merge(self, text: str) -> list[int]:
        """Ids of one part of text: its pieces after merging, unknown ones as their bytes."""
        pieces = self._merge_short(text) if len(text) < _HEAP_FROM else self._merge_heap(text)
        ids: list[int] = []
        for piece in pieces:
            token_id = self._piece_id.get(piece)
            if token_id is None:
                ids += [self._byte_ids[b] for b in piece.encode("utf-8")]
            else:
                ids.append(token_id)
        return ids

    def _merge_short(self, text: str) -> list[str]:
        """The merge loop by rescanning every adjacent pair each step: best score, leftmost."""
        score = self._score
        pieces = list(text)
        while len(pieces) > 1:
            best, at = None, -1
            for i in range(len(pieces) - 1):
                s = score.get(pieces[i] + pieces[i + 1])
                if s is not None and (best is None or s > best):
                    best, at = s, i
            if at < 0:
                break
            pieces[at : at + 2] = [pieces[at] + pieces[at + 1]]
        return pieces

    def _merge_heap(self, text: str) -> list[str]:
        """The same merges as llama.cpp's `llm_tokenizer_spm_session`: candidate pairs in a heap
        ordered by (score, leftmost); a pair whose sides changed since it was pushed is stale
        and skipped. Symbol i covers text[i : i + size[i]], absorbing its right neighbours."""
        score = self._score
        n = len(text)
        size = [1] * n
        after = [*range(1, n), -1]
        before = list(range(-1, n - 1))
        heap = [
            (-score[text[i : i + 2]], i, i + 1, 2) for i in range(n - 1) if text[i : i + 2] in score
        ]
        heapq.heapify(heap)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != merged:
                continue
            size[left], size[right] = merged, 0
            after[left] = nxt = after[right]
            if nxt >= 0:
                before[nxt] = left
                pair = text[left : left + merged + size[nxt]]
                if pair in score:
                    heapq.heappush(heap, (-score[pair], left, nxt, len(pair)))
            prv = before[left]
            if prv >= 0:
                pair = text[prv : prv + size[prv] + merged]
                if pair in score:
                    heapq.heappush(heap, (-score[pair], prv, left, len(pair)))
        pieces, i = [], 0
        while i >= 0:
            pieces.append(text[i : i + size[i]])
            i = after[i]
        return pieces


def _cut_pattern(pieces: Iterable[str]) -> re.Pattern[str]:
    """Where text may be cut into parts merged on their own with the same result: before a "▁"
    that follows a character never followed by "▁" inside a piece. No piece spans such a cut,
    so no merge crosses it, and merges on either side never compete for a symbol. Typical
    vocabularies (pieces start with "▁" or are runs of it) allow a cut before each word; the
    parts repeat, and are cached. Runs of "▁" are never cut: fewer cuts are always safe."""
    before_space = {p[i - 1] for p in pieces for i in range(1, len(p)) if p[i] == SPACE}
    kept = re.escape("".join(sorted(before_space | {SPACE})))
    return re.compile(f"(?<=[^{kept}])(?={SPACE})")

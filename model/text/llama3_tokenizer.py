"""Meta's Llama 3 tokenizer: a `tokenizer.model` file in tiktoken's BPE format (one base64 token
and its rank a line; the rank is the token id) plus the 256 special tokens that Meta's code, not
the file, numbers after the BPE vocabulary.

Owns reading that file format, Llama 3's special-token table and the fallback vocabulary for
random-weight runs. Must never guess at another `tokenizer.model` format: Llama 1/2 ship a
SentencePiece protobuf under the same name, and it is refused by name.
"""

import base64
import binascii
import importlib.util
from pathlib import Path

from model.errors import TokenizerError
from model.text.pretokenizer import LLAMA3_PATTERN
from model.text.tokenizer import Tokenizer

NUM_SPECIAL_TOKENS = 256
# As in Meta's reference tokenizer; ids are assigned in this order after the BPE vocabulary.
_NAMED_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
)
LLAMA3_SPECIAL_TOKENS: tuple[str, ...] = _NAMED_SPECIAL_TOKENS + tuple(
    f"<|reserved_special_token_{2 + i}|>"
    for i in range(NUM_SPECIAL_TOKENS - len(_NAMED_SPECIAL_TOKENS))
)
LLAMA3_NUM_BPE_TOKENS = 128_000


def read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """`token_base64 rank` lines -> {token bytes: rank}; ranks must be exactly 0..n-1."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TokenizerError(f"{path}: cannot read tokenizer ({exc})") from None

    def not_tiktoken(line_number: int) -> TokenizerError:
        # A SentencePiece model is a binary protobuf: it fails on its first bytes.
        return TokenizerError(
            f"{path}: not a tiktoken BPE file (line {line_number} is not '<base64 token> "
            "<rank>'); SentencePiece tokenizer.model files (Llama 1 and 2) are not supported"
        )

    try:
        lines = raw.decode("ascii").splitlines()
    except UnicodeDecodeError:
        raise not_tiktoken(1) from None
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise not_tiktoken(number) from None
    if not ranks or sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: ranks are not the numbers 0..{len(ranks) - 1}, each once")
    return ranks


def _llama3_tokenizer(token_bytes: list[bytes], ranks: dict[bytes, int]) -> Tokenizer:
    first_special = len(token_bytes)
    token_bytes = token_bytes + [t.encode("utf-8") for t in LLAMA3_SPECIAL_TOKENS]
    ids = {t: first_special + i for i, t in enumerate(LLAMA3_SPECIAL_TOKENS)}
    # Raw prompts start with <|begin_of_text|>, as in Meta's text completion and HF's
    # tokenizer; <|eot_id|> and <|eom_id|> join the stop ids as end-of-turn tokens.
    return Tokenizer.from_ranks(
        token_bytes=token_bytes,
        ranks=ranks,
        added=dict.fromkeys(ids.values(), True),
        pattern=LLAMA3_PATTERN,
        eos_id=ids["<|end_of_text|>"],
        bos_id=ids["<|begin_of_text|>"],
        pad_id=ids["<|finetune_right_pad_id|>"],
        add_bos=True,
    )


def llama3_tokenizer(path: str | Path) -> Tokenizer:
    """The Llama 3 tokenizer from Meta's `tokenizer.model`."""
    ranks = read_tiktoken_ranks(path)
    token_bytes = [b""] * len(ranks)
    for token, rank in ranks.items():
        token_bytes[rank] = token
    return _llama3_tokenizer(token_bytes, ranks)


def llama3_byte_tokenizer() -> Tokenizer:
    """A stand-in with Llama 3's vocabulary size and special-token ids for random-weight runs
    when no `tokenizer.model` is at hand: text encodes to one token per UTF-8 byte (ids 0-255).
    The other BPE ids have no text of their own; they decode as `<|bpe_N|>` so that a model
    that emits them still streams visible text."""
    token_bytes = [bytes([b]) for b in range(256)]
    token_bytes += [f"<|bpe_{i}|>".encode() for i in range(256, LLAMA3_NUM_BPE_TOKENS)]
    return _llama3_tokenizer(token_bytes, {bytes([b]): b for b in range(256)})


def bundled_tokenizer_path() -> Path | None:
    """Meta's Llama 3 `tokenizer.model` shipped inside the PyPI package `llama-models`, when that
    package is installed. The package is never imported: llamaserve does not depend on it."""
    spec = importlib.util.find_spec("llama_models")
    locations = (spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / "llama3" / "tokenizer.model"
        if path.is_file():
            return path
    return None

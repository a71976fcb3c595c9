"""Pre-tokenizer regexes: how text is split into pieces before BPE merges them.

Owns the mapping from a checkpoint's pre-tokenizer (a GGUF `tokenizer.ggml.pre` name or
the shape of a `tokenizer.json` pre_tokenizer) to one tiktoken-compatible regex. Must never
guess: an unknown name or shape raises `TokenizerError`, because a wrong split is silent.
"""

import json

from model.errors import TokenizerError

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# `Digits(individual_digits=True)` then the GPT-2 regex, as one regex: every \p{N} is its own
# piece, and the lookahead lets a following digit end a whitespace run ("  12" -> "  ", "1", "2").
DIGITS_GPT2_PATTERN = (
    r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""
)
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
# o200k (GPT-4o, and gpt-oss's o200k_harmony), as tiktoken defines it: case-aware words that
# keep a contraction, digits in threes, punctuation runs that take trailing newlines or '/'.
O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# `tokenizer.ggml.pre` names, grouped as llama.cpp's llama-vocab.cpp groups them by regex.
PATTERN_BY_GGUF_PRE = {
    **dict.fromkeys(["gpt-2", "phi-2", "mpt", "olmo"], GPT2_PATTERN),
    **dict.fromkeys(["smollm", "starcoder", "refact", "codeshell"], DIGITS_GPT2_PATTERN),
    **dict.fromkeys(
        ["llama-bpe", "llama3", "llama-v3", "falcon3", "dbrx", "smaug-bpe"], LLAMA3_PATTERN
    ),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "stablelm2"], QWEN2_PATTERN),
    "gpt-4o": O200K_PATTERN,  # what gpt-oss GGUFs name (llama.cpp: LLAMA_VOCAB_PRE_TYPE_GPT4O)
}


def pattern_from_hf(pre: dict | None) -> str:
    """Maps a `tokenizer.json` pre_tokenizer to one regex, for the shapes whose meaning we know."""
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre or {}]
    *head, last = steps or [{}]
    if last.get("type") == "ByteLevel" and not last.get("add_prefix_space"):
        if last.get("use_regex", True) and not head:
            return GPT2_PATTERN
        if last.get("use_regex", True) and head == [{"type": "Digits", "individual_digits": True}]:
            return DIGITS_GPT2_PATTERN
        split = head[0] if len(head) == 1 and not last.get("use_regex", True) else {}
        if split.get("type") == "Split" and split.get("behavior") == "Isolated":
            if "Regex" in split.get("pattern", {}) and not split.get("invert"):
                return split["pattern"]["Regex"]
    raise TokenizerError(
        f"tokenizer.json pre_tokenizer {json.dumps(pre)} is not a supported shape (ByteLevel, "
        "Digits + ByteLevel, or a Split regex + ByteLevel without regex)"
    )

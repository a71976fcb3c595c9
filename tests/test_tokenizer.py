"""model/text/tokenizer.py against independent references: transformers' tokenizer for the default
GGUF (with its digit pre-tokenizer restored, FACTS.md Trap 2) and for `tokenizer.json`
directories, including small BPE vocabularies trained here for the other pre-tokenizer shapes."""

import json
import random

import pytest
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFBackend
from transformers import AutoTokenizer

from model.errors import TokenizerError
from model.text.detokenizer import IncrementalDetokenizer
from model.text.tokenizer import Tokenizer
from model.text.tokenizer_files import tokenizer_from_gguf, tokenizer_from_hf_dir
from tests.tokenizer_reference import (
    build_corpus,
    smollm_pre_tokenizer,
)

# Regexes as they appear in the original Llama 3 and Qwen2 tokenizer.json files.
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def split_pre_tokenizer(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def mismatches(ours: Tokenizer, reference: list[list[int]], cases: list[str]) -> list[str]:
    report = []
    for text, expected in zip(cases, reference, strict=True):
        got = ours.encode(text)
        if got != expected:
            pieces = [[ours.token_bytes(i) for i in ids] for ids in (got, expected)]
            report.append(
                f"{text!r}\n  ours      {got} {pieces[0]}\n  reference {expected} {pieces[1]}"
            )
    return report


def assert_same_ids(ours: Tokenizer, reference: list[list[int]], cases: list[str]) -> None:
    bad = mismatches(ours, reference, cases)
    assert not bad, f"{len(bad)}/{len(cases)} cases differ, first ones:\n" + "\n".join(bad[:5])


@pytest.fixture(scope="module")
def cases() -> list[str]:
    return build_corpus()


def test_corpus_covers_the_hard_cases(cases):
    text = "".join(cases)
    assert len(text.encode("utf-8")) >= 50_000
    for needle in ("  12", "\n\n1.", "½", "²", "Ⅻ", "①", "🤖", "中", "\u3000", "\r\n", "'S"):
        assert needle in text


def test_gguf_ids_match_transformers(tok, hf_tok, cases):
    reference = hf_tok(cases, add_special_tokens=False)["input_ids"]
    assert_same_ids(tok, reference, cases)


def test_unpatched_transformers_reference_would_differ(tok, hf_tok, cases):
    # The corpus must be able to tell the digit-splitting pre-tokenizer from plain ByteLevel.
    unpatched = HFBackend.from_str(hf_tok.backend_tokenizer.to_str())
    unpatched.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    reference = [e.ids for e in unpatched.encode_batch(cases, add_special_tokens=False)]
    assert len(mismatches(tok, reference, cases)) > len(cases) // 20


def test_known_ids_from_llama_cpp(tok):
    assert tok.encode("  12") == [256, 33, 34]
    assert tok.encode("\n\n1.") == [1116, 33, 30]


def test_hf_dir_ids_match_transformers(tok, hf_dir, cases):
    ours = tokenizer_from_hf_dir(hf_dir)
    reference = AutoTokenizer.from_pretrained(hf_dir)(cases, add_special_tokens=False)
    assert_same_ids(ours, reference["input_ids"], cases)
    attributes = ("vocab_size", "bos_id", "eos_id", "pad_id", "add_bos", "stop_ids")
    assert {a: getattr(ours, a) for a in attributes} == {a: getattr(tok, a) for a in attributes}
    assert ours.special_tokens == tok.special_tokens


def test_attributes_match_transformers(tok, hf_tok):
    assert tok.vocab_size == len(hf_tok) == 49152
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (
        hf_tok.bos_token_id,
        hf_tok.eos_token_id,
        hf_tok.pad_token_id,
    )
    assert tok.add_bos is False and tok.encode("hi") == hf_tok("hi")["input_ids"]
    assert tok.encode("hi", add_bos=True) == [1, *tok.encode("hi")]
    assert tok.special_tokens["<|im_start|>"] == 1 and len(tok.special_tokens) == 17
    assert {2} <= tok.stop_ids <= set(tok.special_tokens.values())


def test_decode_roundtrips_the_corpus(tok, cases):
    bad = [text for text in cases if tok.decode(tok.encode(text)) != text]
    assert not bad, f"{len(bad)} cases do not roundtrip, e.g. {bad[:3]!r}"


@pytest.mark.parametrize(
    "text",
    ["<|im_start|>", "<|im_start|>user\nhi<|im_end|>\n", "a<|endoftext|>b <filename>x.py <|im_end"],
)
def test_special_tokens_only_when_allowed(tok, hf_tok, text):
    as_text = hf_tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    as_special = hf_tok(text, add_special_tokens=False)["input_ids"]
    assert tok.encode(text) == as_text
    assert tok.encode(text, allow_special=True) == as_special
    assert tok.decode(tok.encode(text)) == text == tok.decode(as_special)
    if text == "<|im_start|>":
        assert as_special == [1] and len(as_text) > 1


def test_bytes_without_a_token_are_dropped_like_transformers(tok, hf_tok):
    for text in ["\x04a", "x\U00040000y", "\x13\x14\x16\x1d"]:
        assert tok.encode(text) == hf_tok(text, add_special_tokens=False)["input_ids"]


def test_decode_matches_transformers(tok, hf_tok, cases):
    ids = tok.encode("<|im_start|>user\n" + cases[9] + "<|im_end|><filename>", allow_special=True)
    for skip in (False, True):
        assert tok.decode(ids, skip_special=skip) == hf_tok.decode(ids, skip_special_tokens=skip)
    with pytest.raises(TokenizerError):
        tok.decode([tok.vocab_size])


def test_incremental_detokenizer_is_a_growing_prefix(tok, cases):
    for text in cases:
        ids = tok.encode(text)
        full = tok.decode(ids)
        detok, shown = IncrementalDetokenizer(tok), ""
        for token_id in ids:
            shown += detok.add(token_id)
            assert full.startswith(shown) and "\ufffd" not in shown, (text, shown)
        assert shown + detok.flush() == full


def test_incremental_detokenizer_holds_partial_characters(tok):
    ids = tok.encode("🤖")
    assert [tok.token_bytes(i) for i in ids] == [b"\xf0\x9f", b"\xa4", b"\x96"]
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i) for i in ids] == ["", "", "🤖"]
    # A character that starts in the prompt comes out whole in the output.
    detok = IncrementalDetokenizer(tok, prompt_ids=tok.encode("Robot: ") + ids[:2])
    assert detok.add(ids[2]) == "🤖"


def test_incremental_detokenizer_matches_decode_on_invalid_utf8(tok):
    rng = random.Random(7)
    for _ in range(200):
        ids = [rng.randrange(17, tok.vocab_size) for _ in range(rng.randint(1, 12))]
        detok = IncrementalDetokenizer(tok)
        assert "".join(detok.add(i) for i in ids) + detok.flush() == tok.decode(ids)
    detok = IncrementalDetokenizer(tok, skip_special=True)
    assert detok.add(2) == "" and detok.add(tok.encode("x")[0]) == "x"


def test_unknown_pre_tokenizers_are_refused(gguf_metadata, trained, tmp_path):
    with pytest.raises(TokenizerError, match="no-such-pre"):
        tokenizer_from_gguf({**gguf_metadata, "tokenizer.ggml.pre": "no-such-pre"})
    with pytest.raises(TokenizerError, match="'bert'.*'gpt2'.*'llama'"):
        tokenizer_from_gguf({**gguf_metadata, "tokenizer.ggml.model": "bert"})
    shapes = [
        {"type": "Metaspace", "replacement": "▁"},
        {"type": "Whitespace"},
        None,
        {"type": "ByteLevel", "add_prefix_space": True, "use_regex": True},
        {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": False},
                {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
            ],
        },
    ]
    for n, shape in enumerate(shapes):
        write_hf_dir(tmp_path / str(n), {**trained, "pre_tokenizer": shape})
        with pytest.raises(TokenizerError, match="pre_tokenizer"):
            tokenizer_from_hf_dir(tmp_path / str(n))
    write_hf_dir(tmp_path / "nfkc", {**trained, "normalizer": {"type": "NFKC"}})
    with pytest.raises(TokenizerError, match="normalizer"):
        tokenizer_from_hf_dir(tmp_path / "nfkc")
    assert issubclass(TokenizerError, ValueError)


# Small vocabularies trained on half the corpus stand in for checkpoints we cannot download.


@pytest.fixture(scope="module")
def trained(cases) -> dict:
    backend = HFBackend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000,
        special_tokens=["<|endoftext|>", "<|begin_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(cases[::2], trainer)
    backend.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    return json.loads(backend.to_str())


def write_hf_dir(path, spec: dict) -> None:
    path.mkdir()
    (path / "tokenizer.json").write_text(json.dumps(spec))
    config = {"eos_token": "<|endoftext|>", "bos_token": "<|begin_of_text|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def llama3_shape(spec: dict) -> dict:
    backend = HFBackend.from_str(json.dumps(spec))
    backend.pre_tokenizer = split_pre_tokenizer(LLAMA3_REGEX)
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 1)]
    )
    return json.loads(backend.to_str())


def shuffled_ids(spec: dict) -> dict:
    vocab = spec["model"]["vocab"]
    movable = sorted(i for i in vocab.values() if i > 1)
    targets = random.Random(3).sample(movable, len(movable))
    remap = dict(zip(movable, targets, strict=True))
    new_vocab = {text: remap.get(i, i) for text, i in vocab.items()}
    added = [{**t, "id": remap.get(t["id"], t["id"])} for t in spec["added_tokens"]]
    return {**spec, "model": {**spec["model"], "vocab": new_vocab}, "added_tokens": added}


@pytest.mark.parametrize("shape", ["gpt2", "llama3", "shuffled_ids", "nfc"])
def test_trained_hf_dirs_match_transformers(trained, cases, tmp_path, shape):
    spec = {
        "gpt2": lambda s: s,
        "llama3": llama3_shape,
        "shuffled_ids": shuffled_ids,
        "nfc": lambda s: {**s, "normalizer": {"type": "NFC"}},
    }[shape](trained)
    write_hf_dir(tmp_path / shape, spec)
    texts = [*cases, "use <tool> now", "<tool><tool>x", "Cafe\u0301"]
    hf = AutoTokenizer.from_pretrained(tmp_path / shape)
    ours = tokenizer_from_hf_dir(tmp_path / shape)
    reference = hf(texts)["input_ids"]
    assert_same_ids(ours, reference, texts)
    assert ours.add_bos == (shape == "llama3") and ours.bos_id == 1 and ours.eos_id == 0
    assert ours.decode(ours.encode(texts[0], add_bos=False)) == texts[0]


@pytest.mark.parametrize(
    ("gguf_pre", "reference_pre"),
    [
        ("gpt-2", pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)),
        ("starcoder", smollm_pre_tokenizer()),
        ("llama-bpe", split_pre_tokenizer(LLAMA3_REGEX)),
        ("qwen2", split_pre_tokenizer(QWEN2_REGEX)),
    ],
)
def test_gguf_pre_tokenizer_names(trained, cases, gguf_pre, reference_pre):
    reference = HFBackend.from_str(json.dumps(trained))
    reference.pre_tokenizer = reference_pre
    tokens = sorted(trained["model"]["vocab"], key=trained["model"]["vocab"].get) + ["<tool>"]
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": gguf_pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3] + [1] * (len(tokens) - 3) + [4],
        "tokenizer.ggml.merges": [" ".join(m) for m in trained["model"]["merges"]],
        "tokenizer.ggml.eos_token_id": 0,
    }
    ours = tokenizer_from_gguf(metadata)
    texts = [*cases, "use <tool> now", "<tool><tool>x"]
    expected = [e.ids for e in reference.encode_batch(texts, add_special_tokens=False)]
    assert_same_ids(ours, expected, texts)
    # The reference matches special-token text as specials: ours does that only when allowed.
    text = "a <|endoftext|> b"
    assert ours.encode(text, allow_special=True) == reference.encode(text).ids


@pytest.mark.parametrize(
    "tokens, merges, named",
    [
        # A raw space, a control character and a CJK character stand for no byte in GPT-2's
        # byte-to-unicode form (a space is "Ġ"), in a token or in a merge.
        (["a", "b", "a b"], [], "token 2 'a b'"),
        (["a", "\x07"], [], "token 1"),
        (["a", "中"], [], "token 1"),
        (["a", "b", "ab"], [("a", " b")], "merge 0"),
    ],
)
def test_a_vocabulary_that_is_not_byte_level_is_refused(tokens, merges, named) -> None:
    """Every character of a byte-level BPE token stands for one byte; Ġ (U+0120) for a
    space, ā (U+0101) for byte 1."""
    with pytest.raises(TokenizerError, match=named):
        Tokenizer(tokens=tokens, merges=merges, added={}, pattern=r"\S+", eos_id=0)
    byte_level = Tokenizer(tokens=["Ġ", "ā", "a"], merges=[], added={}, pattern=r"\S+", eos_id=0)
    assert byte_level.decode([0, 2, 1]) == " a\x01"

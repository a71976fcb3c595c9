"""A tiny random checkpoint that speaks harmony, gpt-oss's chat format: `make_tiny`'s Qwen2
weights (written by `transformers`) with a vocabulary of o200k_harmony's size and layout, and
the chat template gpt-oss ships.

- The template, `gpt_oss_chat_template.jinja`, is the `chat_template.jinja` of the
  openai/gpt-oss-120b checkpoint as llama.cpp keeps a copy of it
  (`models/templates/openai-gpt-oss-120b.jinja`, read from the fork corbinjurgens/llama.cpp at
  commit 33732cb5df65; 16,717 characters, sha256 below). gpt-oss-20b ships the same template.
- The vocabulary: o200k_harmony's pre-tokenizer regex and its special tokens at their ids
  (`<|start|>` = 200006 ...), both read from tiktoken's own definition of the encoding
  (`tiktoken_ext.openai_public.o200k_harmony`). Its 199,998 BPE ranks are a download that
  is not reachable here, so the BPE part is a small byte-level BPE trained on the template's
  own words, padded to 199,998 tokens with tokens no merge reaches, so every id sits where
  o200k_harmony has it and `transformers` numbers the tokens exactly as we do.
"""

import hashlib
import json
from pathlib import Path
from typing import Any
from unittest import mock

import tiktoken_ext.openai_public as openai_public

from tests.tiny_families import make_tiny

TEMPLATE_PATH = Path(__file__).with_name("gpt_oss_chat_template.jinja")
TEMPLATE_SHA256 = "52f245ae1d6b27142cb8cdee024f2e15be759148b39ee59812e2dc862ed66e4b"
NUM_BPE = 199_998  # o200k_harmony's ranks; its special tokens start here
VOCAB_SIZE = 201_088


def gpt_oss_template() -> str:
    text = TEMPLATE_PATH.read_text(encoding="utf-8")
    assert hashlib.sha256(text.encode()).hexdigest() == TEMPLATE_SHA256
    return text


def o200k_harmony() -> dict[str, Any]:
    """tiktoken's definition of o200k_harmony (regex, special tokens), without the ranks
    it would download: the loader is handed the 256 single bytes instead."""
    single_bytes = {bytes([b]): b for b in range(256)}
    with mock.patch.object(openai_public, "load_tiktoken_bpe", lambda *a, **k: single_bytes):
        return openai_public.o200k_harmony()


def _corpus() -> list[str]:
    words = gpt_oss_template().replace('"', " ").replace("{", " ").replace("}", " ")
    return [words, "The weather in Paris is sunny. get_weather city Paris location"] * 4


def _gpt2_chars() -> dict[int, str]:
    """GPT-2's `bytes_to_unicode`: each byte's character in byte-level BPE vocabularies."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}


def _byte_level(raw: bytes, chars: dict[int, str]) -> str:
    return "".join(chars[b] for b in raw)


def write_harmony_tokenizer(directory: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    spec = o200k_harmony()
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(spec["pat_str"]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1200,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(), trainer)
    tokenizer = json.loads(backend.to_str())
    vocab = tokenizer["model"]["vocab"]
    # Padding no merge reaches: byte 0xFF never occurs in UTF-8 text.
    chars = _gpt2_chars()
    for i in range(NUM_BPE - len(vocab)):
        vocab[_byte_level(b"\xff" + i.to_bytes(3, "big"), chars)] = len(vocab)
    # tiktoken's table names 200018 twice (o200k_base's `<|endofprompt|>` and a reserved
    # slot); gpt-oss's tokenizer.json keeps the real name.
    name_of: dict[int, str] = {}
    for text, token_id in spec["special_tokens"].items():
        if token_id not in name_of or name_of[token_id].startswith("<|reserved_"):
            name_of[token_id] = text
    specials = sorted((text, token_id) for token_id, text in name_of.items())
    specials.sort(key=lambda item: item[1])
    tokenizer["added_tokens"] = [
        {
            "id": token_id,
            "content": text,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for text, token_id in specials
    ]
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = {
        "bos_token": "<|startoftext|>",
        "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",  # as gpt-oss names it
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "chat_template.jinja").write_text(gpt_oss_template(), encoding="utf-8")
    # gpt-oss's own generation_config.json: <|return|>, <|endoftext|>, <|call|>.
    generation = {"bos_token_id": 199998, "eos_token_id": [200002, 199999, 200012]}
    (directory / "generation_config.json").write_text(json.dumps(generation))


def make_tiny_harmony(directory: Path) -> Path:
    make_tiny(
        "qwen2",
        directory,
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    write_harmony_tokenizer(directory)
    return directory

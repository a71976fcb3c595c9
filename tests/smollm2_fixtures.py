"""Fixtures shared by the tokenizer and chat-template tests: the default model's GGUF
metadata, our tokenizer built from it, and the patched HF reference tokenizer saved as an
HF directory. Loaded once per session; a module may define its own `tok` to override."""

import pytest

from model.text.tokenizer import Tokenizer
from model.text.tokenizer_files import tokenizer_from_gguf
from tests.tokenizer_reference import smollm2_hf_tokenizer, smollm2_metadata


@pytest.fixture(scope="session")
def gguf_metadata() -> dict:
    return smollm2_metadata()


@pytest.fixture(scope="session")
def tok(gguf_metadata) -> Tokenizer:
    return tokenizer_from_gguf(gguf_metadata)


@pytest.fixture(scope="session")
def hf_tok():
    return smollm2_hf_tokenizer()


@pytest.fixture(scope="session")
def hf_dir(hf_tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("smollm2-tokenizer")
    hf_tok.save_pretrained(path)
    return path

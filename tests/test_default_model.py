"""The bundled SmolLM2-135M-Instruct GGUF through llamaserve against `transformers`
loading the same file (`gguf_file=`): logits and greedy text.

Token ids come from the HF tokenizer, so this tests the network and the weight
loading (dequantisation, the Q/K permutation, tied embeddings) in isolation."""

import pytest
import torch

from model.greedy import greedy_tokens

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "人工智能是",
    "I love pizza 🍕 because",
    "1, 2, 3, 5, 8, 13,",
    "Translate to German: The weather is nice today.",
    "SELECT name FROM users WHERE",
]
CHAT = [{"role": "user", "content": "What is the tallest mountain in the world?"}]


@pytest.fixture(scope="module")
def prompt_ids(hf_default):
    _, tok = hf_default
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    chat = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    ids.append(tok(chat, add_special_tokens=False)["input_ids"])
    return ids


def test_default_model_shape(ours_default):
    c = ours_default.config
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert c.tie_embeddings and c.rope_theta == 100000.0


def test_logits_match_transformers(hf_default, ours_default, prompt_ids, device):
    from model.network.batch import Batch
    from model.network.paged_cache import PagedKVCache

    hf, _ = hf_default
    model = ours_default.model
    worst = 0.0
    for ids in prompt_ids[:4] + prompt_ids[-1:]:
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0]
        cache = PagedKVCache.allocate(model.config, 16, 16, device=device)
        batch = Batch.build([ids], [0], [list(range(16))], 16, device, all_logits=True)
        got = model(batch, cache).cpu()
        worst = max(worst, (got - want).abs().max().item())
    assert worst < 1e-3, worst


@pytest.mark.slow
def test_greedy_matches_transformers(hf_default, ours_default, prompt_ids):
    """transformers, teacher-forced on our greedy continuation, predicts each of its
    tokens: its own greedy generation would be the same 24 tokens, in one forward per
    prompt rather than 24 steps."""
    hf, _ = hf_default
    assert len(prompt_ids) >= 8
    for ids in prompt_ids:
        got = list(greedy_tokens(ours_default.model, ids, 24))
        assert len(got) == 24
        with torch.no_grad():
            logits = hf(torch.tensor([ids + got[:-1]]), logits_to_keep=len(got)).logits[0]
        assert logits.argmax(-1).tolist() == got, (ids, got)

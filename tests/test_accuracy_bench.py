"""The accuracy harness (bench/accuracy.py) on two tiny random checkpoints, checked against
`transformers` running the same two: its distributions, its agreement counts and its KL
divergence must be what transformers' logits give."""

import torch
import torch.nn.functional as F

from bench.accuracy import compare, next_token_logprobs, prompt_ids, reference
from model.loader import load_model
from tests.tiny_models import make_tiny_llama, write_tiny_tokenizer

QUESTIONS = ["The quick brown fox", "Hello there, how are you?", "1, 2, 3,"]
TOKENS = 12
NOISE = 0.003


def hf_logprobs(hf, ids: list[int], first: int) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, first - 1 : len(ids) - 1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_agreement_is_what_transformers_logits_give(tmp_path) -> None:
    ours_dir, other_dir = tmp_path / "a", tmp_path / "b"
    hf = make_tiny_llama(ours_dir, heads="gqa")
    # The same checkpoint with its weights moved a little: close enough to agree for a
    # while and then part, as a quantised format does.
    other_hf = make_tiny_llama(other_dir, heads="gqa")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in other_hf.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * NOISE)
    other_hf.save_pretrained(other_dir)
    for directory in (ours_dir, other_dir):
        write_tiny_tokenizer(directory)
    exact = load_model(ours_dir, dtype="float32", quantization="none", progress=False)
    other = load_model(other_dir, dtype="float32", quantization="none", progress=False)
    prompts = prompt_ids(exact, QUESTIONS)
    references = reference(exact.model, prompts, TOKENS)

    # The reference continuation is transformers' greedy one, its distributions transformers'.
    for ref in references:
        ids = ref.prompt + ref.tokens
        want = hf_logprobs(hf, ids, len(ref.prompt))
        assert want.argmax(-1).tolist() == ref.tokens
        torch.testing.assert_close(
            next_token_logprobs(exact.model, ids, len(ref.prompt)), want, atol=1e-4, rtol=0
        )

    same = compare(exact.model, references)
    assert (same.identical, same.before_first_difference) == (len(QUESTIONS), same.tokens)
    assert (same.top1, same.mean_kl, same.worst_logprob) == (same.tokens, 0.0, 0.0)

    # Another checkpoint: every figure as computed from transformers' two sets of logits.
    got = compare(other.model, references)
    top1, kl, worst, identical, before = 0, 0.0, 0.0, 0, 0
    for ref in references:
        ids, first = ref.prompt + ref.tokens, len(ref.prompt)
        p, q = hf_logprobs(hf, ids, first), hf_logprobs(other_hf, ids, first)
        top1 += int((p.argmax(-1) == q.argmax(-1)).sum())
        kl += float(F.kl_div(q, p, log_target=True, reduction="sum"))
        chosen = torch.tensor(ref.tokens)[:, None]
        worst = max(worst, float((q.gather(1, chosen) - p.gather(1, chosen)).abs().max()))
        with torch.no_grad():
            out = other_hf.generate(
                torch.tensor([ref.prompt]),
                attention_mask=torch.ones(1, first, dtype=torch.long),
                max_new_tokens=TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        own = out[0, first:].tolist()
        identical += own == ref.tokens
        parts = [i for i, (a, b) in enumerate(zip(own, ref.tokens, strict=True)) if a != b]
        before += parts[0] if parts else TOKENS
    assert got.tokens == len(QUESTIONS) * TOKENS
    assert got.top1 == top1 < got.tokens
    assert (got.identical, got.before_first_difference) == (identical, before)
    assert 0 < before < got.tokens
    assert abs(got.mean_kl - kl / got.tokens) < 1e-4 * max(1.0, kl / got.tokens)
    assert 0.0 < got.mean_kl
    assert abs(got.worst_logprob - worst) < 1e-3

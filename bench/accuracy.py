"""How far each weight format's output is from the float32 model's, on the same prompts:
the figures behind the accuracy table of docs/cpu-performance.md, reproducible with one command.

    python -m bench.accuracy --formats bfloat16:int4 bfloat16:w4a8 float32:int4
    python -m bench.accuracy --kv-cache int8 --contexts 512 4096   # bench/kv_accuracy.py

Greedy, so that a difference is the format's and not the sampler's. Per format, over
every prompt: how many of float32's greedy continuations it reproduces whole, and how
many tokens in all before each first differs; then, with float32's continuation fed to
both (teacher forcing, so one early difference does not decide the rest), how often the
two agree on the most likely next token, the mean KL divergence of the format's
next-token distribution from float32's, and the largest difference in the logprob of
float32's token. The free-running counts move by one or two between formats that round
differently in the last bit; the teacher-forced figures are the steadier ones.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from bench.kv_accuracy import SIMULATED, report
from model.greedy import greedy_tokens
from model.loader import LoadedModel, load_model
from model.network.batch import Batch
from model.network.llama import Llama
from model.network.paged_cache import PagedKVCache

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three uses of a paperclip.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish and German.",
    "Who wrote Pride and Prejudice?",
    "Give me a Python function that reverses a string.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet.",
    "What are the planets of the solar system?",
    "How do I boil an egg?",
    "Tell me a joke about computers.",
    "What is the difference between a virus and a bacterium?",
    "Describe a cat to someone who has never seen one.",
    "What is machine learning?",
    "Name five fruits that are red.",
    "How many days are in a leap year?",
    "What does HTTP stand for?",
    "Write a short email declining a meeting.",
    "What is the boiling point of water in Fahrenheit?",
    "Suggest a name for a bakery.",
    "How does a bicycle stay upright?",
    "What is the largest ocean on Earth?",
]


@dataclass
class Continuation:
    """float32's greedy tokens after a prompt, and its log-softmax at each of them."""

    prompt: list[int]
    tokens: list[int]
    logprobs: torch.Tensor  # [len(tokens), vocab] fp32


@dataclass
class Agreement:
    prompts: int
    identical: int  # continuations reproduced whole
    tokens: int
    before_first_difference: int  # summed over prompts
    top1: int  # teacher-forced positions whose argmax agrees
    mean_kl: float  # KL(float32 || format) per position, in nats
    worst_logprob: float  # largest |difference| in the logprob of float32's token


def prompt_ids(loaded: LoadedModel, questions: list[str]) -> list[list[int]]:
    """Chat prompts where the model has a template (as a chat client sends them), plain
    text otherwise."""
    if loaded.chat_template is None:
        return [loaded.tokenizer.encode(q) for q in questions]
    return [
        loaded.chat_template.prompt_ids([{"role": "user", "content": q}], loaded.tokenizer)
        for q in questions
    ]


def next_token_logprobs(model: Llama, ids: list[int], first: int) -> torch.Tensor:
    """log-softmax of the next-token logits at positions first-1 .. len(ids)-2, all in
    one prefill: the distributions that predicted ids[first:]."""
    block_size = 16
    blocks = -(-len(ids) // block_size)
    cache = PagedKVCache.allocate(model.config, blocks, block_size, model.norm.weight.dtype)
    batch = Batch.build([ids], [0], [list(range(blocks))], block_size, all_logits=True)
    logits = model(batch, cache)[first - 1 : len(ids) - 1]
    return torch.log_softmax(logits.float(), dim=-1)


def reference(model: Llama, prompts: list[list[int]], tokens: int) -> list[Continuation]:
    out = []
    for prompt in prompts:
        generated = list(greedy_tokens(model, prompt, tokens))
        logprobs = next_token_logprobs(model, prompt + generated, len(prompt))
        out.append(Continuation(prompt, generated, logprobs))
    return out


def compare(model: Llama, references: list[Continuation]) -> Agreement:
    identical = before = top1 = positions = 0
    kl, worst = 0.0, 0.0
    for ref in references:
        n = len(ref.tokens)
        own = list(greedy_tokens(model, ref.prompt, n))
        first = next((i for i, (a, b) in enumerate(zip(own, ref.tokens, strict=True)) if a != b), n)
        identical += first == n
        before += first
        logprobs = next_token_logprobs(model, ref.prompt + ref.tokens, len(ref.prompt))
        top1 += int((logprobs.argmax(-1) == ref.logprobs.argmax(-1)).sum())
        kl += float((ref.logprobs.exp() * (ref.logprobs - logprobs)).sum())
        chosen = torch.tensor(ref.tokens)[:, None]
        gap = (logprobs.gather(1, chosen) - ref.logprobs.gather(1, chosen)).abs().max()
        worst = max(worst, float(gap))
        positions += n
    return Agreement(
        len(references), identical, positions, before, top1, kl / max(positions, 1), worst
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="as `llamaserve serve --model` (default: bundled)")
    p.add_argument(
        "--formats",
        nargs="+",
        default=["bfloat16:int4", "auto:auto", "bfloat16:w4a8", "float32:int4", "bfloat16:none"],
        help="dtype:quantization pairs, as `--dtype` and `--quantization` take them",
    )
    p.add_argument("--tokens", type=int, default=48, help="greedy tokens per prompt")
    p.add_argument(
        "--kv-cache",
        nargs="+",
        choices=["bfloat16", "int8", *SIMULATED],
        help="instead of weight formats, these KV-cache formats against a float32 cache "
        "on the float32 model, teacher-forced over a long text (bench/kv_accuracy.py)",
    )
    p.add_argument("--contexts", nargs="+", type=int, default=[512, 4096])
    args = p.parse_args()

    exact = load_model(args.model, dtype="float32", quantization="none", progress=False)
    if args.kv_cache:
        report(exact, args.kv_cache, args.contexts)
        return
    prompts = prompt_ids(exact, QUESTIONS)
    references = reference(exact.model, prompts, args.tokens)
    del exact
    print(f"{len(prompts)} prompts x {args.tokens} greedy tokens, against float32")
    header = "format", "identical", "before 1st diff", "top-1 (forced)", "mean KL", "max |dlogp|"
    print("{:<22} {:>10} {:>16} {:>15} {:>10} {:>12}".format(*header))
    for spec in args.formats:
        dtype, _, quantization = spec.partition(":")
        loaded = load_model(
            args.model, dtype=dtype, quantization=quantization or "none", progress=False
        )
        a = compare(loaded.model, references)
        print(
            f"{spec:<22} {a.identical:>5} / {a.prompts:<3} {a.before_first_difference:>7} / "
            f"{a.tokens:<6} {a.top1:>6} / {a.tokens:<6} {a.mean_kl:>10.5f} {a.worst_logprob:>12.3f}"
        )
        del loaded


if __name__ == "__main__":
    main()

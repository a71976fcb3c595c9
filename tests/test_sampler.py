"""model/sampler.py against per-row Python references and analytic distributions."""

import math
import os
import random
import shutil

import pytest
import torch

from model.native.ops import NativeArgmax
from model.sampler import Sampler, SamplingMetadata, greedy_ids

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    ),
]

# Chi-square critical values at p = 0.001, by degrees of freedom.
CHI2_CRITICAL_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def metadata(rows: int, vocab: int, device: str = "cpu", **per_row) -> SamplingMetadata:
    """Metadata for `rows` rows with every option off unless given as a per-row list."""
    fields = {
        "temperature": [1.0] * rows,
        "top_k": [0] * rows,
        "top_p": [1.0] * rows,
        "min_p": [0.0] * rows,
        "presence_penalty": [0.0] * rows,
        "frequency_penalty": [0.0] * rows,
        "repetition_penalty": [1.0] * rows,
        "logit_bias": [None] * rows,
        "suppress_ids": [[] for _ in range(rows)],
        "prompt_ids": [[] for _ in range(rows)],
        "output_ids": [[] for _ in range(rows)],
        "generators": [None] * rows,
    }
    num_logprobs = per_row.pop("num_logprobs", -1)
    fields.update(per_row)
    return SamplingMetadata.build(
        **fields, num_logprobs=num_logprobs, vocab_size=vocab, device=device
    )


def seeded(seed: int, device: str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device):
    torch.manual_seed(0)
    logits = torch.randn(16, 100, device=device)
    out = Sampler()(logits, metadata(16, 100, device, temperature=[0.0] * 16))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))

    # Greedy rows inside a sampling batch still take their argmax.
    temperature = [0.0, 1.0] * 8
    out = Sampler()(logits, metadata(16, 100, device, temperature=temperature))
    assert torch.equal(out.token_ids[::2], logits[::2].argmax(dim=-1))


@pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None and not os.environ.get("CI"),
    reason="no C compiler to build the kernels",
)
def test_greedy_ids_are_torch_argmax():
    """The C argmax (model/native/argmax.c) against torch.argmax: ties across and within
    its chunks, infinities, NaN (which torch ranks first), signed zeros, a row narrower
    than the tensor, widths off the chunk size."""
    generator = torch.Generator().manual_seed(3)
    nan, inf = float("nan"), float("inf")
    cases = [torch.randn(32, 49152, generator=generator), torch.randn(3, 1, generator=generator)]
    for width in (1000, 513, 512, 7):
        rows = torch.randn(9, width, generator=generator)
        rows[1, [3, width - 1]] = 100.0  # equal maxima: the first wins
        rows[2, [width // 2, width // 3]] = 100.0
        rows[3] = -inf
        rows[4, width - 1] = inf
        rows[5, [width // 2, width - 1]] = nan
        rows[6] = -1.0
        rows[6, [width // 3, width // 2]] = torch.tensor([-0.0, 0.0])
        rows[7, [width - 1, width // 2]] = torch.tensor([-nan, 50.0])
        rows[8] = rows[8].round()  # many ties
        cases += [rows, torch.randn(5, width + 40, generator=generator)[:, :width]]
    kernel = NativeArgmax()
    for logits in cases:
        assert torch.equal(kernel(logits), logits.argmax(dim=-1)), logits.shape
    assert greedy_ids(cases[0]).tolist() == kernel(cases[0]).tolist()


def test_top_k_one_is_greedy():
    torch.manual_seed(1)
    logits = torch.randn(64, 200)
    meta = metadata(64, 200, top_k=[1] * 64)
    for _ in range(5):
        assert torch.equal(Sampler()(logits, meta).token_ids, logits.argmax(dim=-1))


def test_caller_logits_untouched():
    torch.manual_seed(2)
    logits = torch.randn(4, 30)
    before = logits.clone()
    meta = metadata(
        4,
        30,
        temperature=[0.0, 0.7, 1.0, 1.3],
        top_k=[0, 5, 0, 3],
        top_p=[1.0, 0.8, 0.5, 1.0],
        min_p=[0.0, 0.0, 0.1, 0.05],
        repetition_penalty=[1.3, 1.0, 1.0, 0.8],
        frequency_penalty=[0.0, 0.5, 0.0, 0.0],
        logit_bias=[{1: 5.0}, None, None, None],
        suppress_ids=[[2], [], [3], []],
        output_ids=[[1, 1, 4], [5], [], [6]],
        prompt_ids=[[7], [8], [9], [10]],
    )
    Sampler()(logits, meta)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_ignores_its_batch(device):
    vocab, steps = 64, 20
    make = torch.Generator().manual_seed(3)
    # Flat-ish logits, so that tokens genuinely vary from draw to draw.
    step_logits = [0.5 * torch.randn(5, vocab, generator=make) for _ in range(steps)]
    target = {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "min_p": 0.01}

    def run_alone(seed: int) -> list[int]:
        gen = seeded(seed, device)
        meta_args = {k: [v] for k, v in target.items()}
        tokens = []
        for i, logits in enumerate(step_logits):
            torch.manual_seed(100 + i)  # the default RNG must not matter to a seeded row
            meta = metadata(1, vocab, device, generators=[gen], **meta_args)
            tokens.append(int(Sampler()(logits[2:3].to(device), meta).token_ids[0]))
        return tokens

    def run_batched(seed: int) -> list[int]:
        gens = [None, seeded(99, device), seeded(seed, device), None, seeded(7, device)]
        meta = metadata(
            5,
            vocab,
            device,
            temperature=[0.8, 1.2, target["temperature"], 0.0, 1.0],
            top_k=[0, 5, target["top_k"], 0, 0],
            top_p=[1.0, 1.0, target["top_p"], 0.5, 0.9],
            min_p=[0.1, 0.0, target["min_p"], 0.0, 0.0],
            generators=gens,
            num_logprobs=3,
        )
        torch.manual_seed(12345)
        return [int(Sampler()(x.to(device), meta).token_ids[2]) for x in step_logits]

    alone = run_alone(1234)
    assert alone == run_alone(1234)
    assert alone == run_batched(1234)
    assert alone != run_alone(4321)
    assert len(set(alone)) > 5  # the row really sampled


# A toy row with its order shuffled, so a sort that loses track of ids is caught.
TOY_LOGITS = [0.5, -1.0, 2.0, 0.0, 1.0, -0.5]


def softmax_over(ids: list[int], temperature: float) -> dict[int, float]:
    weights = {i: math.exp(TOY_LOGITS[i] / temperature) for i in ids}
    total = sum(weights.values())
    return {i: w / total for i, w in weights.items()}


# Kept ids worked out by hand. At temperature 1 the probabilities, by rank, are
# id2 .538, id4 .198, id0 .120, id3 .0728, id5 .0442, id1 .0268.
STAT_CASES = {
    "plain": ({}, [0, 1, 2, 3, 4, 5], 1.0),
    "temperature 0.5": ({"temperature": 0.5}, [0, 1, 2, 3, 4, 5], 0.5),
    "top_k 3": ({"top_k": 3}, [2, 4, 0], 1.0),
    # .538 < .7, then .538 + .198 = .736 reaches .7: two ids.
    "top_p 0.7": ({"top_p": 0.7}, [2, 4], 1.0),
    # floor .1 * .538 = .0538: .0728 stays, .0442 goes.
    "min_p 0.1": ({"min_p": 0.1}, [2, 4, 0, 3], 1.0),
    # At temperature 2 the top four renormalise to .409 .248 .193 .150; top_p 0.8 is
    # reached by the third (.850), where unrenormalised mass (.703) would keep a fourth.
    "temperature 2, top_k 4, top_p 0.8": (
        {"temperature": 2.0, "top_k": 4, "top_p": 0.8},
        [2, 4, 0],
        2.0,
    ),
}


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_distribution_matches_analytic(device):
    """All cases share one batch, so per-row parameters must stay on their own rows."""
    draws = 20_000
    names = list(STAT_CASES)
    per_row: dict[str, list] = {"temperature": [], "top_k": [], "top_p": [], "min_p": []}
    defaults = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    for name in names:
        params = STAT_CASES[name][0]
        for key, default in defaults.items():
            per_row[key] += [params.get(key, default)] * draws
    rows = draws * len(names)
    logits = torch.tensor(TOY_LOGITS, device=device).expand(rows, -1).contiguous()
    torch.manual_seed(2024)
    tokens = Sampler()(logits, metadata(rows, 6, device, **per_row)).token_ids.cpu()

    for n, name in enumerate(names):
        _, kept, temperature = STAT_CASES[name]
        counts = torch.bincount(tokens[n * draws : (n + 1) * draws], minlength=6).tolist()
        expected = softmax_over(kept, temperature)
        assert all(counts[i] == 0 for i in range(6) if i not in expected), (name, counts)
        chi2 = sum((counts[i] - draws * p) ** 2 / (draws * p) for i, p in expected.items())
        assert chi2 < CHI2_CRITICAL_P001[len(kept) - 1], (name, chi2, counts)


def reference_processed(
    logits: list[float],
    prompt: list[int],
    output: list[int],
    presence: float,
    frequency: float,
    repetition: float,
    bias: dict[int, float] | None,
    suppress: list[int],
) -> list[float]:
    out = list(logits)
    for token, value in (bias or {}).items():
        out[token] += value
    for token in suppress:
        out[token] = -math.inf
    seen = set(prompt) | set(output)
    for token in range(len(out)):
        if token in seen:
            out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
        count = output.count(token)
        out[token] -= frequency * count + presence * (count > 0)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_and_bias_match_reference(device):
    rng = random.Random(5)
    rows, vocab = 8, 40
    torch.manual_seed(5)
    logits = 3 * torch.randn(rows, vocab)

    def random_ids(max_len: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(rng.randrange(max_len))]

    case = {
        "prompt_ids": [random_ids(12) for _ in range(rows)],
        "output_ids": [random_ids(15) for _ in range(rows)],
        "presence_penalty": [rng.choice([0.0, 0.5, -1.0, 2.0]) for _ in range(rows)],
        "frequency_penalty": [rng.choice([0.0, 0.3, -0.5, 1.5]) for _ in range(rows)],
        "repetition_penalty": [rng.choice([1.0, 1.2, 0.7, 2.0]) for _ in range(rows)],
        "logit_bias": [
            {rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(3)} if r % 2 else None
            for r in range(rows)
        ],
        "suppress_ids": [rng.sample(range(vocab), r % 3) for r in range(rows)],
    }
    case["output_ids"][0] = [4, 4, 4, 9]  # repeats, for the frequency count
    case["presence_penalty"][0], case["frequency_penalty"][0] = 0.5, 0.3
    expected = torch.tensor(
        [
            reference_processed(
                logits[r].tolist(),
                prompt=case["prompt_ids"][r],
                output=case["output_ids"][r],
                presence=case["presence_penalty"][r],
                frequency=case["frequency_penalty"][r],
                repetition=case["repetition_penalty"][r],
                bias=case["logit_bias"][r],
                suppress=case["suppress_ids"][r],
            )
            for r in range(rows)
        ]
    )
    meta = metadata(rows, vocab, device, temperature=[0.0] * rows, **case)
    processed = Sampler().process_logits(logits.to(device), meta).cpu()
    torch.testing.assert_close(processed, expected, rtol=1e-5, atol=1e-4)
    out = Sampler()(logits.to(device), meta)
    assert torch.equal(out.token_ids.cpu(), expected.argmax(dim=-1))


@pytest.mark.parametrize("device", DEVICES)
def test_suppressed_ids_never_sampled(device):
    rows, vocab = 400, 20
    logits = torch.zeros(rows, vocab, device=device)
    logits[:, :3] = 10.0  # without suppression these three would win nearly every draw
    suppress = [[0, 1, 2]] * rows
    temperature = [0.0] + [1.0] * (rows - 1)
    meta = metadata(rows, vocab, device, temperature=temperature, suppress_ids=suppress)
    torch.manual_seed(6)
    for _ in range(5):
        tokens = Sampler()(logits, meta).token_ids
        assert int(tokens.min()) >= 3
    assert len(set(tokens.tolist())) > 10


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw(device):
    rows, vocab, top_n = 7, 50, 5
    torch.manual_seed(7)
    logits = torch.randn(rows, vocab, device=device)
    shaping = {
        "temperature": [0.0, 0.5, 1.5, 1.0, 0.7, 0.0, 1.0],
        "top_k": [0, 3, 0, 10, 0, 0, 2],
        "repetition_penalty": [1.5] * rows,
        "logit_bias": [{0: 30.0}] + [None] * (rows - 1),
        "output_ids": [[1, 2, 3]] * rows,
    }
    raw = torch.log_softmax(logits, dim=-1)

    out = Sampler()(logits, metadata(rows, vocab, device, num_logprobs=top_n, **shaping))
    assert int(out.token_ids[0]) == 0  # the bias moved the choice, not the logprob
    chosen = raw.gather(-1, out.token_ids[:, None]).squeeze(-1)
    torch.testing.assert_close(out.logprobs, chosen)
    top_values, top_ids = torch.topk(raw, top_n, dim=-1)
    assert torch.equal(out.top_ids, top_ids)
    torch.testing.assert_close(out.top_logprobs, top_values)

    only_chosen = Sampler()(logits, metadata(rows, vocab, device, num_logprobs=0, **shaping))
    assert only_chosen.logprobs is not None and only_chosen.top_ids is None
    none = Sampler()(logits, metadata(rows, vocab, device, **shaping))
    assert none.logprobs is None and none.top_ids is None and none.top_logprobs is None


def pack_bitmask(allowed: list[list[int]], vocab: int):
    """llguidance's layout, written independently: bit t % 32 of int32 word t // 32."""
    import numpy as np

    words = (vocab + 31) // 32
    out = np.zeros((len(allowed), words), dtype=np.uint32)
    for row, ids in enumerate(allowed):
        for t in ids:
            out[row, t // 32] |= np.uint32(1 << (t % 32))
    return out.view(np.int32)


@pytest.mark.parametrize("device", DEVICES)
def test_token_bitmask_confines_only_its_rows(device):
    torch.manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word is partly past the vocabulary
    logits = torch.randn(4, vocab, device=device)
    allowed = [[3, 31, 32, 99], [64]]
    masks = pack_bitmask(allowed, vocab)
    per_row = [masks[0], None, masks[1], None]
    for temperature in (0.0, 1.0):
        meta = metadata(4, vocab, device, temperature=[temperature] * 4, token_bitmasks=per_row)
        for _ in range(20):
            out = Sampler()(
                logits,
                meta,
            ).token_ids.tolist()
            assert out[0] in allowed[0] and out[2] == 64
        processed = Sampler().process_logits(logits, meta)
        finite = [torch.isfinite(processed[r]).nonzero().flatten().tolist() for r in range(4)]
        assert finite == [allowed[0], list(range(vocab)), allowed[1], list(range(vocab))]
    # Unconstrained rows are untouched and greedy rows take the masked argmax.
    meta = metadata(4, vocab, device, temperature=[0.0] * 4, token_bitmasks=per_row)
    out = Sampler()(logits, meta).token_ids.tolist()
    best = max(allowed[0], key=lambda t: logits[0, t].item())
    assert out == [best, logits[1].argmax().item(), 64, logits[3].argmax().item()]


def test_apply_token_bitmask_masks_ids_past_the_bitmask():
    from model.token_bitmask import apply_token_bitmask

    logits = torch.zeros(1, 70)
    apply_token_bitmask(logits, torch.tensor([0]), torch.from_numpy(pack_bitmask([[1, 33]], 64)))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [1, 33]

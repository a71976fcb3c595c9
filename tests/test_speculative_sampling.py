"""Speculation on sampled requests keeps the target's distribution: on a tiny random
checkpoint with a 64-token vocabulary, the frequencies of thousands of seeded samples
match the probabilities `transformers` gives for the same weights (chi-square), for
guesses the target likes and guesses it almost never picks; and each seeded request gets
the tokens it gets without speculation."""

import pytest
import torch
from scipy.stats import chisquare

from model.loader import load_model
from scheduler.config import EngineConfig
from scheduler.engine.factory import create_engine
from scheduler.sampling_params import SamplingParams
from scheduler.spec.speculation import SpeculativeConfig
from tests.tiny_models import make_tiny_llama, write_tiny_tokenizer

VOCAB = 64
SAMPLES = 2000
TEMPERATURE = 0.2  # the tiny model's logits are flat; this puts most mass on a few tokens
SIGNIFICANCE = 1e-3
# The prompt holds every token once, so lookup on one token always finds the last
# sampled one in it and guesses the two tokens that followed it there.
LOOKUP = SpeculativeConfig(
    num_speculative_tokens=2,
    prompt_lookup_min=1,
    prompt_lookup_max=1,
    disable_by_batch_size=SAMPLES,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-sampling")
    hf = make_tiny_llama(directory, vocab_size=VOCAB)
    write_tiny_tokenizer(directory, fill=False)  # larger than the model's vocabulary
    loaded = load_model(directory, dtype="float32", quantization="none", progress=False)
    return hf, loaded


def target_probs(hf, prompts: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor(prompts)).logits[:, -1].double()
    return torch.softmax(logits / TEMPERATURE, dim=-1)


def prompt_for(hf, agreement: str) -> tuple[list[int], int]:
    """A permutation of the vocabulary, and its likeliest next token X, where the token
    after X in it (the first guess once X is sampled) is the target's favourite next
    one, or one it gives almost no chance."""
    order = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1)).tolist()
    for _ in range(8):
        likeliest = int(target_probs(hf, [order])[0].argmax())
        at = order.index(likeliest)
        if at == VOCAB - 1:  # nothing follows it: rotate and look again
            order = order[-1:] + order[:-1]
            continue
        after = target_probs(hf, [order + [likeliest]])[0]
        guess = order[at + 1]
        if agreement == "agrees_badly" and after[guess] < 1e-3:
            return order, likeliest
        favourite = int(after.argmax())
        if agreement == "agrees_well" and guess == favourite:
            return order, likeliest
        swap = order.index(favourite if agreement == "agrees_well" else int(after.argmin()))
        order[at + 1], order[swap] = order[swap], order[at + 1]
    raise AssertionError(f"no prompt found whose guess {agreement}")


def run(loaded, prompt: list[int], speculative: SpeculativeConfig | None):
    engine = create_engine(
        loaded.model,
        loaded.tokenizer,
        EngineConfig(
            max_num_seqs=256,
            max_num_batched_tokens=4096,
            max_waiting=SAMPLES,
            speculative=speculative,
        ),
    )
    requests = {
        f"s{seed}": (
            prompt,
            SamplingParams(max_tokens=4, temperature=TEMPERATURE, seed=seed, ignore_eos=True),
        )
        for seed in range(SAMPLES)
    }
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    accepted = 0
    while engine.has_work():
        outputs, stats = engine.step()
        accepted += stats.spec.num_accepted_tokens if stats.spec is not None else 0
        for out in outputs:
            tokens[out.request_id] += out.new_token_ids
    return list(tokens.values()), accepted


def assert_follows(observed: torch.Tensor, expected: torch.Tensor) -> None:
    """Chi-square goodness of fit; cells expected fewer than 5 times share one bin."""
    big = expected >= 5
    counts = [*observed[big].tolist(), observed[~big].sum().item()]
    wanted = [*expected[big].tolist(), expected[~big].sum().item()]
    assert len(counts) >= 6  # enough bins for the test to see a wrong distribution
    assert chisquare(counts, wanted).pvalue > SIGNIFICANCE


def assert_next_two_follow(hf, prompt: list[int], tokens: list[list[int]], head: list[int]):
    """Where the output began with `head`, the two tokens after it, jointly, against the
    target's probabilities of one and then the other. Returns how many began so."""
    after = [t[len(head) : len(head) + 2] for t in tokens if t[: len(head)] == head]
    context = prompt + head
    one = target_probs(hf, [context])[0]
    two = target_probs(hf, [context + [t] for t in range(VOCAB)])
    pairs = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for a, b in after:
        pairs[a, b] += 1
    assert_follows(pairs.flatten(), (one[:, None] * two * len(after)).flatten())
    return len(after)


@pytest.mark.parametrize("agreement", ["agrees_well", "agrees_badly"])
def test_samples_follow_the_target(tiny, agreement) -> None:
    hf, loaded = tiny
    prompt, likeliest = prompt_for(hf, agreement)
    tokens, accepted = run(loaded, prompt, LOOKUP)
    first_guess, second_guess = prompt[prompt.index(likeliest) + 1 :][:2]
    # The first token comes from the prompt's step, with nothing to verify. Once it is X,
    # the step after verifies X's two guesses: the second token is the sample at the
    # first guess's row; the third is the sample at the second's, kept only where the
    # first guess was taken, otherwise the next step's own.
    began = assert_next_two_follow(hf, prompt, tokens, [likeliest])
    assert began > SAMPLES // 4
    took_first = sum(t[:2] == [likeliest, first_guess] for t in tokens)
    if agreement == "agrees_well":
        assert accepted > SAMPLES // 2 and took_first > 0.8 * began
        # The fourth after an accepted first guess: the second guess's verification
        # (its row's sample) or, where it was taken, the bonus row's.
        assert_next_two_follow(hf, prompt, tokens, [likeliest, first_guess])
        assert any(t[1:3] == [first_guess, second_guess] for t in tokens)
        # Seeded: the draw at each output position is the request's own, whatever the
        # step verified, so the tokens are those of decoding one a step.
        assert tokens == run(loaded, prompt, None)[0]
    else:
        assert 0 < accepted and took_first < 0.01 * began

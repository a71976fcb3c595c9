"""scheduler/sampling_params.py's SamplingParams: the one home of the sampling rules every layer
below relies on (greedy is temperature 0.0; top_k off is 0), applied at construction."""

import pytest

from scheduler.sampling_params import GREEDY_TEMPERATURE, InvalidParams, SamplingParams


@pytest.mark.parametrize("temperature", [0.0, 1e-6, GREEDY_TEMPERATURE / 2])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature: float) -> None:
    params = SamplingParams(temperature=temperature, seed=1234)
    assert params.greedy and params.temperature == 0.0


@pytest.mark.parametrize("temperature", [GREEDY_TEMPERATURE, 0.7, 2.0])
def test_other_temperatures_sample(temperature: float) -> None:
    params = SamplingParams(temperature=temperature)
    assert not params.greedy and params.temperature == temperature


def test_a_negative_temperature_is_refused_not_made_greedy() -> None:
    with pytest.raises(InvalidParams, match="temperature"):
        SamplingParams(temperature=-1e-6)


def test_top_k_off_is_zero() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=10**30, vocab_size=49152).top_k == 0
    assert SamplingParams(top_k=49152, vocab_size=49152).top_k == 0
    assert SamplingParams(top_k=49151, vocab_size=49152).top_k == 49151
    assert SamplingParams(top_k=50).top_k == 50

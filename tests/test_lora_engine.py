"""LoRA adapters through the engine: a batch that mixes three adapters and the base,
crowded, chunked and preempted, gives each request the greedy tokens it gets alone; the
prefix cache never hands one adapter's KV to another; eviction under load fails nobody."""

import pytest
import torch
from transformers import LlamaForCausalLM

from model.loader import load_model
from scheduler.config import EngineConfig
from scheduler.engine.factory import create_engine
from scheduler.lora_request import LoraRequest
from scheduler.sampling_params import SamplingParams
from scheduler.spec.speculation import SpeculativeConfig
from tests.engine_driver import run_engine
from tests.lora_adapters import make_adapter
from tests.tiny_models import make_tiny_llama, write_tiny_tokenizer

MAX_TOKENS = 12
BYTES_PER_BLOCK = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 KV heads of 16, fp32


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("base")
    make_tiny_llama(directory)
    write_tiny_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def served(base_dir, tmp_path_factory):
    """The tiny base and three PEFT adapters of it (ranks 8, 16, 8 with rsLoRA)."""
    loras = []
    for index, (rank, rslora) in enumerate([(8, False), (16, False), (8, True)]):
        directory = tmp_path_factory.mktemp(f"adapter{index}")
        make_adapter(LlamaForCausalLM.from_pretrained(base_dir), directory, rank, rslora, index)
        loras.append(LoraRequest(f"a{index}", index + 1, str(directory)))
    loaded = load_model(base_dir, dtype="float32", quantization="none", progress=False)
    return loaded, loras


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 500, (20,), generator=g).tolist()
    # Two requests share a long prompt (under two adapters), the rest are their own.
    own = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (9, 30, 17, 41, 5, 23)]
    return [shared + [7], shared + [7]] + own


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def engine(loaded, **kwargs):
    # A fixed token budget: measuring the prefill speed for each engine costs seconds.
    settings = dict(max_loras=3, max_lora_rank=16, max_num_batched_tokens=512) | kwargs
    return create_engine(loaded.model, loaded.tokenizer, EngineConfig(**settings))


def serve(loaded, loras_of, ids_list, e=None, **kwargs):
    e = e or engine(loaded, **kwargs)
    requests = {f"r{i}": (ids, greedy()) for i, ids in enumerate(ids_list)}
    loras = {f"r{i}": lora for i, lora in enumerate(loras_of) if lora is not None}
    results, preemptions = run_engine(e, requests, loras=loras)
    assert e.scheduler.kv.num_used_blocks == 0
    return [results[(f"r{i}", 0)].token_ids for i in range(len(ids_list))], preemptions, e


@pytest.fixture(scope="module")
def mix(served):
    loaded, loras = served
    ps = prompts()
    assignment = [loras[0], loras[1], None, loras[2], loras[0], None, loras[1], loras[2]]
    e = engine(loaded)
    alone = [
        serve(loaded, [lora], [ids], e)[0][0] for ids, lora in zip(ps, assignment, strict=True)
    ]
    base = serve(loaded, [None], [ps[0]], e)[0][0]
    return ps, assignment, alone, base


SCENARIOS = {
    "crowded": dict(),
    "no_prefix_cache": dict(enable_prefix_caching=False),
    "chunked_prefill": dict(max_num_batched_tokens=7),
    "preemption": dict(kv_cache_memory=5 * BYTES_PER_BLOCK),
    # Guesses verified under each row's adapter.
    "ngram_speculation": dict(
        speculative=SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    ),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_mixed_batch_gives_each_request_its_tokens_alone(served, mix, scenario):
    loaded, _ = served
    ps, assignment, alone, base = mix
    got, preemptions, _ = serve(loaded, assignment, ps, **SCENARIOS[scenario])
    if scenario == "preemption":
        assert preemptions > 0
    assert got == alone
    # The two requests of one prompt under two adapters differ: the adapters matter.
    assert alone[0] != alone[1]
    assert base not in (alone[0], alone[1])


def test_two_adapters_never_share_a_cached_prefix(served, mix):
    loaded, loras = served
    ps = mix[0]
    shared = [ps[0], ps[0], ps[0]]
    on, _, e = serve(loaded, [loras[0], loras[1], None], shared)
    off, _, _ = serve(loaded, [loras[0], loras[1], None], shared, enable_prefix_caching=False)
    assert on == off
    assert len(set(map(tuple, on))) == 3
    # Served again, each request hits its own adapter's cached blocks.
    before = e.scheduler.kv.prefix_cache_hits
    again, _ = run_engine(e, {"x": (ps[0], greedy())}, loras={"x": loras[1]})
    assert e.scheduler.kv.prefix_cache_hits > before
    assert again[("x", 0)].token_ids == on[1]


def test_more_adapters_than_slots_evict_and_reload_without_failing(served, mix):
    loaded, loras = served
    ps, _, alone_of, _ = mix
    # Three adapters through one slot: each waits for the one before it to finish.
    assignment = [loras[0], loras[1], None, loras[2], loras[0], None, loras[1], loras[2]]
    e = create_engine(loaded.model, loaded.tokenizer, EngineConfig(max_loras=1, max_lora_rank=16))
    requests = {f"r{i}": (ids, greedy()) for i, ids in enumerate(ps)}
    results, _ = run_engine(
        e, requests, loras={f"r{i}": lo for i, lo in enumerate(assignment) if lo}
    )
    assert [results[(f"r{i}", 0)].token_ids for i in range(len(ps))] == alone_of
    assert all(results[(f"r{i}", 0)].finish_reason == "length" for i in range(len(ps)))
    assert e.runner.adapters.num_loads >= 4  # evicted and read again from disk


def test_n_siblings_share_their_adapters_prompt(served, mix):
    loaded, loras = served
    ps, assignment, alone, _ = mix
    e = engine(loaded)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, n=2)
    results, _ = run_engine(e, {"r": (ps[1], params)}, loras={"r": assignment[1]})
    assert results[("r", 0)].token_ids == results[("r", 1)].token_ids == alone[1]


def test_an_adapter_gone_from_disk_fails_its_request_alone(served, mix, tmp_path):
    loaded, _ = served
    ps, _, _, base = mix
    gone = LoraRequest("gone", 99, str(tmp_path / "deleted"))
    e = engine(loaded)
    results, _ = run_engine(
        e, {"lost": (ps[0], greedy()), "kept": (ps[0], greedy())}, loras={"lost": gone}
    )
    assert results[("lost", 0)].finish_reason == "error"
    assert "neither a directory nor a file" in results[("lost", 0)].outputs[-1].error
    assert results[("kept", 0)].token_ids == base
    assert e.scheduler.kv.num_used_blocks == 0


def test_adapter_rows_on_the_c_decoder_layer_keep_their_tokens(base_dir, served, monkeypatch):
    """bfloat16 w4a8 runs every layer on the C decoder layer, decodes in one call per layer,
    with the adapter rows' update in C: a batch of three adapters and the base gives each
    request its tokens alone, and the tokens of the PyTorch layers with the hooks (their
    A and B in fp32, the C layer's in bf16: this tiny model's greedy margins are wider than
    that rounding, so the tokens still agree)."""
    from model.native.layer import NativeDecoderLayer

    _, loras = served
    loaded = load_model(base_dir, dtype="bfloat16", quantization="w4a8", progress=False)
    e = engine(loaded)
    layers = loaded.model.layers
    assert all(layer.native is not None and layer.native.lora for layer in layers)
    decoded = []
    one_call = NativeDecoderLayer.decode

    def spy(self, *args, **kwargs):
        out = one_call(self, *args, **kwargs)
        decoded.append(out is not None and self._step.struct.row_slots is not None)
        return out

    monkeypatch.setattr(NativeDecoderLayer, "decode", spy)
    ps, assignment = prompts()[2:6], [loras[0], loras[1], None, loras[2]]
    alone = [serve(loaded, [lo], [ids], e)[0][0] for ids, lo in zip(ps, assignment, strict=True)]
    got = serve(loaded, assignment, ps, e)[0]
    assert any(decoded)  # adapter rows through the one-call decode
    assert got == alone
    for layer in layers:
        layer.native.lora = False  # the PyTorch layers, through the hooks
    assert serve(loaded, assignment, ps, e)[0] == got
    assert len({tuple(tokens) for tokens in got}) == 4

"""The CUDA path on a real GPU (marker `cuda`; skipped where none is visible; `make
test-gpu` runs these and the rest of the suite with --device cuda): the Triton backend in
fp32 against the CPU reference, bf16 against fp32, CUDA-graph replay against eager steps,
the KV budget measured from a profiling step, and speculative decoding (n-gram and a draft
model) against plain greedy output."""

import pytest
import torch

from model.attention import attention_backend
from model.loader import load_model
from scheduler.config import EngineConfig
from scheduler.engine.factory import create_engine
from scheduler.sampling_params import SamplingParams
from scheduler.spec.speculation import SpeculativeConfig
from tests.engine_driver import run_engine
from tests.tiny_models import random_draft

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TEXTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time"]


@pytest.fixture(scope="module")
def cpu_fp32():
    return load_model(device="cpu", progress=False)


def _logits(loaded, ids: list[int]) -> torch.Tensor:
    from model.network.batch import Batch
    from model.network.paged_cache import PagedKVCache

    device = loaded.model.embed_tokens.weight.device
    dtype = loaded.model.embed_tokens.weight.dtype
    blocks = -(-len(ids) // 16)
    cache = PagedKVCache.allocate(loaded.config, blocks, 16, dtype, device)
    batch = Batch.build([ids], [0], [list(range(blocks))], 16, device, all_logits=True)
    return loaded.model(batch, cache).cpu()


def test_triton_fp32_matches_cpu_reference(cpu_fp32) -> None:
    gpu = load_model(device="cuda", progress=False)
    assert gpu.model.attention.name == "triton_paged"
    for text in TEXTS:
        ids = cpu_fp32.tokenizer.encode(text)
        torch.testing.assert_close(_logits(gpu, ids), _logits(cpu_fp32, ids), rtol=0, atol=1e-3)


def test_bf16_agrees_with_fp32(cpu_fp32) -> None:
    """bf16 weights and cache on the GPU land no further from fp32 than the CPU's bf16 path
    does (log-probabilities, which a shift common to every logit leaves alone; bf16 moves
    this model's logits by up to 1.3 on the CPU too), and the argmax of nearly every
    position agrees with fp32."""
    gpu = load_model(device="cuda", dtype="bfloat16", progress=False)
    cpu_bf16 = load_model(device="cpu", dtype="bfloat16", progress=False)
    agree = total = 0
    for text in TEXTS:
        ids = cpu_fp32.tokenizer.encode(text)
        ref = torch.log_softmax(_logits(cpu_fp32, ids), -1)
        got = torch.log_softmax(_logits(gpu, ids).float(), -1)
        cpu = torch.log_softmax(_logits(cpu_bf16, ids).float(), -1)
        assert (got - ref).abs().max() <= 1.5 * (cpu - ref).abs().max(), text
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += len(ids)
    assert agree >= 0.9 * total


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_equals_eager(dtype: str) -> None:
    loaded = load_model(device="cuda", dtype=dtype, progress=False)
    tok = loaded.tokenizer
    requests = {
        f"r{i}": (tok.encode(t), SamplingParams(max_tokens=8 + 4 * i, temperature=0.0, logprobs=0))
        for i, t in enumerate(TEXTS)
    }
    results = {}
    for eager in (True, False):
        config = EngineConfig(max_num_seqs=16, kv_cache_memory=2**28, enforce_eager=eager)
        engine = create_engine(loaded.model, tok, config)
        assert (engine.runner.decode_graphs is None) == eager
        results[eager], _ = run_engine(engine, dict(requests))
    for key, ref in results[True].items():
        got = results[False][key]
        assert got.token_ids == ref.token_ids
        lp = [[x.logprob for o in r.outputs for x in o.logprobs or []] for r in (ref, got)]
        torch.testing.assert_close(torch.tensor(lp[1]), torch.tensor(lp[0]), rtol=0, atol=1e-3)


def test_kv_budget_is_measured_from_a_profiling_step() -> None:
    loaded = load_model(device="cuda", dtype="bfloat16", progress=False)
    engine = create_engine(loaded.model, loaded.tokenizer, EngineConfig(gpu_memory_utilization=0.5))
    runner = engine.runner
    cache_bytes = runner.kv_cache.k.nbytes + runner.kv_cache.v.nbytes
    total = torch.cuda.mem_get_info()[1]
    assert 0 < cache_bytes < 0.5 * total
    assert torch.cuda.memory_allocated() < 0.5 * total + 2**30


def test_auto_backend_on_cuda_is_triton() -> None:
    assert attention_backend("auto", "cuda").name == "triton_paged"


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_keeps_greedy_output(method: str) -> None:
    """Verifying steps (several rows of one sequence) run eagerly beside the decode graphs,
    the draft model runs on the GPU too: the greedy tokens are the plain run's, the logprobs
    within fp32's shape-dependent rounding, prompts in chunks and every request at once."""
    loaded = load_model(device="cuda", progress=False)
    tok = loaded.tokenizer
    texts = TEXTS + ["Count from one: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=0)
    requests = {f"r{i}": (tok.encode(t), params) for i, t in enumerate(texts)}
    budget = dict(max_num_seqs=16, kv_cache_memory=2**28, max_num_batched_tokens=12)
    plain, _ = run_engine(create_engine(loaded.model, tok, EngineConfig(**budget)), requests)
    draft = None
    if method == "draft_model":
        draft = random_draft(loaded.config, "cuda")
        spec = SpeculativeConfig(
            num_speculative_tokens=3, method="draft_model", model="draft", draft_p_min=0.0,
            disable_by_batch_size=64,
        )  # fmt: skip
    else:
        spec = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=64)
    engine = create_engine(loaded.model, tok, EngineConfig(speculative=spec, **budget), draft)
    assert engine.runner.decode_graphs is not None
    for rid, (ids, p) in requests.items():
        engine.add_request(rid, ids, p)
    got: dict = {}
    drafted = 0
    while engine.has_work():
        outputs, stats = engine.step()
        drafted += stats.spec.num_draft_tokens if stats.spec is not None else 0
        for out in outputs:
            got.setdefault((out.request_id, out.index), []).append(out)
    assert drafted > 0
    for key, ref in plain.items():
        assert [t for o in got[key] for t in o.new_token_ids] == ref.token_ids, key
        lp = [[x.logprob for o in r for x in o.logprobs or []] for r in (ref.outputs, got[key])]
        torch.testing.assert_close(torch.tensor(lp[1]), torch.tensor(lp[0]), rtol=0, atol=1e-3)
    engine.scheduler.kv.check_invariants()
    assert engine.scheduler.kv.num_used_blocks == 0

"""The whole model through the `triton_paged` attention backend against the reference
backend on the same weights (a tiny GQA checkpoint written by transformers): logits of a
mixed step within 1e-4, and through the engine, with chunked prefill and a prefix-cache
hit, the same greedy tokens and logprobs within 1e-4. Without a GPU the kernels run under
Triton's interpreter."""

import pytest
import torch

pytest.importorskip("triton")

from model.attention import attention_backend  # noqa: E402
from model.checkpoint.safetensors import iter_safetensors, safetensors_files  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.network.batch import Batch  # noqa: E402
from model.network.llama import Llama  # noqa: E402
from model.network.paged_cache import PagedKVCache  # noqa: E402
from scheduler.config import EngineConfig  # noqa: E402
from scheduler.engine.factory import create_engine  # noqa: E402
from scheduler.runner.decode_graphs import DecodeGraphs, graph_batch_sizes  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402
from tests.engine_driver import run_engine  # noqa: E402
from tests.tiny_models import make_tiny_llama  # noqa: E402

TOL = 1e-4
BLOCK = 16


@pytest.fixture
def one_thread():
    """Under the interpreter a kernel is Python either way; one thread also skips the
    engine's start-up timing of one-token steps on one and on two threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_gqa(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("gqa")
    make_tiny_llama(path, heads="gqa")
    return path


class _Loaded:
    def __init__(self, path, backend: str, device: str) -> None:
        self.config = ModelConfig.from_hf_dir(path)
        self.model = Llama.empty(self.config, device=device)
        weights = iter_safetensors(safetensors_files(path), torch.float32)
        self.model.load_weights((n, t.to(device)) for n, t in weights)
        self.model.attention = attention_backend(backend, device)


def _load(path, backend: str, device: str) -> _Loaded:
    return _Loaded(path, backend, device)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8], ids=["fp32", "int8"])
def test_mixed_step_logits_match_reference(tiny_gqa, device: str, kv_dtype) -> None:
    """Both on the same cache format; int8: written by each backend's own quantiser."""
    ref = _load(tiny_gqa, "torch_ref", device)
    tri = _load(tiny_gqa, "triton_paged", device)
    assert tri.model.attention.name == "triton_paged"
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 3, 21)]
    logits = {}
    for name, loaded in (("ref", ref), ("tri", tri)):
        cache = PagedKVCache.allocate(loaded.config, 12, BLOCK, kv_dtype, device)
        tables = [[0, 1, 2], [3], [4, 5]]
        # Step 1: whole prompts, except the first's last 10 tokens.
        first = [prompts[0][:30], prompts[1], prompts[2]]
        batch = Batch.build(first, [0, 0, 0], tables, BLOCK, device, null_block=cache.null_block)
        loaded.model(batch, cache)
        # Step 2, mixed: a prefill chunk over a 30-token cached prefix, and two decodes.
        step = [prompts[0][30:], [7], [9]]
        batch = Batch.build(
            step, [30, 3, 21], tables, BLOCK, device, all_logits=True, null_block=cache.null_block
        )
        logits[name] = loaded.model(batch, cache)
    assert logits["ref"].shape == (12, 512)
    torch.testing.assert_close(logits["tri"], logits["ref"], rtol=0, atol=TOL)


def test_engine_greedy_and_logprobs_match_reference(tiny_gqa, device: str, one_thread) -> None:
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 512, (2 * BLOCK + 5,), generator=g).tolist()
    prompts = {
        "a": shared + [11, 12, 13],
        "b": shared + [21, 22],  # hits a's two full prefix blocks
        "c": torch.randint(0, 512, (50,), generator=g).tolist(),
    }
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True)
    # 24 tokens a step: the 40- and 50-token prompts are prefilled in chunks.
    config = EngineConfig(max_num_batched_tokens=24, kv_cache_memory=2**20, block_size=BLOCK)
    results = {}
    for backend in ("torch_ref", "triton_paged"):
        engine = create_engine(_load(tiny_gqa, backend, device).model, _tokenizer(tiny_gqa), config)
        first, _ = run_engine(engine, {"a": (prompts["a"], params)})
        rest, _ = run_engine(engine, {k: (prompts[k], params) for k in ("b", "c")})
        assert engine.scheduler.kv.prefix_cache_hits >= 2 * BLOCK
        results[backend] = {**first, **rest}
    for key, ref in results["torch_ref"].items():
        tri = results["triton_paged"][key]
        assert tri.token_ids == ref.token_ids, key
        ref_lp = [lp.logprob for out in ref.outputs for lp in out.logprobs or []]
        tri_lp = [lp.logprob for out in tri.outputs for lp in out.logprobs or []]
        assert len(ref_lp) == 12
        torch.testing.assert_close(torch.tensor(tri_lp), torch.tensor(ref_lp), rtol=0, atol=TOL)


def _tokenizer(path):
    """The tiny checkpoint has no tokenizer; the engine only detokenizes its ids."""
    from model.text.llama3_tokenizer import llama3_byte_tokenizer

    return llama3_byte_tokenizer()


def test_graph_batch_sizes_cover_every_batch() -> None:
    sizes = graph_batch_sizes(20)
    assert sizes == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(1) == [1]
    assert all(any(s >= n for s in sizes) for n in range(1, 21))


def test_decode_steps_on_static_buffers_match_ordinary_steps(
    tiny_gqa, device: str, one_thread
) -> None:
    """The decode-graph path (padded static buffers) run without capture, which any device
    can do: batches of 5, 4, 3 ... sequences pad up to the ladder's 8 and 4."""
    g = torch.Generator().manual_seed(2)
    prompts = {f"r{i}": torch.randint(0, 512, (3 + 9 * i,), generator=g).tolist() for i in range(5)}
    config = EngineConfig(
        max_num_seqs=8, max_num_batched_tokens=256, kv_cache_memory=2**20, block_size=BLOCK
    )
    results = {}
    for graphs in (False, True):
        engine = create_engine(
            _load(tiny_gqa, "triton_paged", device).model, _tokenizer(tiny_gqa), config
        )
        runner = engine.runner
        calls = []
        if graphs:
            static = DecodeGraphs(
                runner.model, runner.kv_cache, 8, runner.max_model_len, capture=False
            )
            original = static.run
            static.run = lambda batch, run=original, seen=calls: (
                seen.append(batch.num_seqs) or run(batch)
            )
            runner.decode_graphs = static
        # Different lengths finish at different steps, so the batch shrinks as it runs.
        requests = {
            rid: (
                ids,
                SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, logprobs=0, ignore_eos=True),
            )
            for i, (rid, ids) in enumerate(prompts.items())
        }
        results[graphs], _ = run_engine(engine, requests)
        if graphs:
            assert {5, 4, 3} <= set(calls)
    for key, eager in results[False].items():
        padded = results[True][key]
        assert padded.token_ids == eager.token_ids, key
        lp = [[x.logprob for o in r.outputs for x in o.logprobs or []] for r in (eager, padded)]
        torch.testing.assert_close(torch.tensor(lp[1]), torch.tensor(lp[0]), rtol=0, atol=1e-5)

"""LoRA adapters on the model side (model/lora/): float32 logits of a batch that mixes
adapters and the base against PEFT's own model and its `merge_and_unload()`, for PEFT
directories and the same adapters as GGUF LoRA files; and the refusals."""

import json

import pytest
import torch

from model.loader import load_model
from model.lora import AdapterError, read_adapter
from model.lora.hooks import attach_lora
from model.lora.slots import LoraSlots
from model.network.batch import Batch
from model.network.paged_cache import PagedKVCache
from tests.lora_adapters import make_adapter, write_gguf_lora
from tests.tiny_families import make_tiny
from tests.tiny_models import make_tiny_llama, write_tiny_tokenizer

BLOCK = 16
PROMPTS = [[5, 9, 101, 7, 300, 44, 2, 17, 250], [11, 3, 480, 66, 99], [1, 2, 3, 4, 5, 6, 7]]
# (family, rank, rsLoRA, rank_pattern): ranks 8 and 16, rsLoRA on and off, per-module ranks.
CASES = {
    "llama-r8": ("llama", 8, False, {}),
    "llama-r16-rslora": ("llama", 16, True, {"down_proj": 8}),
    "qwen2-r8-rslora": ("qwen2", 8, True, {}),
    "qwen2-r16": ("qwen2", 16, False, {"q_proj": 4}),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    family, rank, rslora, pattern = CASES[request.param]
    base_dir = tmp_path_factory.mktemp(f"{request.param}-base")
    if family == "llama":
        hf = make_tiny_llama(base_dir)
        write_tiny_tokenizer(base_dir)
    else:
        hf = make_tiny(family, base_dir)
    adapter_dir = tmp_path_factory.mktemp(f"{request.param}-adapter")
    peft_model = make_adapter(hf, adapter_dir, rank, rslora, rank_pattern=pattern)
    ours = load_model(base_dir, dtype="float32", quantization="none", progress=False)
    gguf_path = adapter_dir / "adapter.gguf"
    c = ours.config
    write_gguf_lora(peft_model, gguf_path, c.architecture, c.n_heads, c.n_kv_heads)
    # One alpha for the whole file (scale = alpha / rank): per-module ranks under rsLoRA
    # have no GGUF form, so that case checks the PEFT directory only.
    return peft_model, ours, adapter_dir, None if rslora and pattern else gguf_path


def peft_logits(peft_model, ids: list[int], adapter: bool) -> torch.Tensor:
    with torch.no_grad():
        if adapter:
            return peft_model(torch.tensor([ids])).logits[0].float()
        with peft_model.disable_adapter():
            return peft_model(torch.tensor([ids])).logits[0].float()


def mixed_logits(ours, slots: list[int]) -> list[torch.Tensor]:
    """One forward over the three prompts, sequence i with adapter slot slots[i]."""
    cache = PagedKVCache.allocate(ours.config, 64, BLOCK)
    tables, start = [], 0
    for ids in PROMPTS:
        n = -(-len(ids) // BLOCK)
        tables.append(list(range(start, start + n)))
        start += n
    batch = Batch.build(PROMPTS, [0] * len(PROMPTS), tables, BLOCK, all_logits=True)
    batch.lora_slots = slots
    logits = ours.model(batch, cache)
    out, row = [], 0
    for ids in PROMPTS:
        out.append(logits[row : row + len(ids)])
        row += len(ids)
    return out


def test_a_batch_of_adapters_and_the_base_matches_peft(case):
    peft_model, ours, adapter_dir, gguf_path = case
    slots = LoraSlots(ours.config, max_loras=3, max_rank=16, device="cpu")
    attach_lora(ours.model, slots)
    slots.load(0, read_adapter("peft", adapter_dir, ours.config))
    slots.load(2, read_adapter("other", gguf_path or adapter_dir, ours.config))
    got = mixed_logits(ours, [0, -1, 2])
    for ids, logits, adapter in zip(PROMPTS, got, [True, False, True], strict=True):
        want = peft_logits(peft_model, ids, adapter)
        assert (logits - want).abs().max().item() < 1e-4
    # The adapter matters: without it the logits are far from PEFT's.
    assert (got[1] - peft_logits(peft_model, PROMPTS[1], True)).abs().max().item() > 1e-2
    merged = peft_model.merge_and_unload()
    with torch.no_grad():
        want = merged(torch.tensor([PROMPTS[0]])).logits[0].float()
    assert (got[0] - want).abs().max().item() < 1e-4


def write_peft_dir(directory, config: dict, tensors: dict) -> None:
    from safetensors.torch import save_file

    directory.mkdir()
    base = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    (directory / "adapter_config.json").write_text(json.dumps({**base, **config}))
    save_file(tensors, str(directory / "adapter_model.safetensors"))


Q_PAIR = {
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 64),
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(64, 4),
}


@pytest.mark.parametrize(
    ("config", "tensors", "words"),
    [
        ({"use_dora": True}, Q_PAIR, "DoRA"),
        ({"target_modules": ["q_proj", "lm_head"]}, Q_PAIR, "lm_head"),
        ({"modules_to_save": ["embed_tokens"]}, Q_PAIR, "saves whole modules"),
        (
            {},
            {**Q_PAIR, "base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(4, 8)},
            "cannot adapt",
        ),
        (
            {},
            {k: v[:, :32].contiguous() if "lora_A" in k else v for k, v in Q_PAIR.items()},
            "another base model: layer 0 q_proj maps 32 -> 64, the base.s maps 64 -> 64",
        ),
        (
            {},
            {k.replace("layers.0", "layers.7"): v for k, v in Q_PAIR.items()},
            "adapts layer 7, but the base model has 2 layers",
        ),
    ],
)
def test_an_adapter_the_base_cannot_serve_is_refused(tmp_path, case, config, tensors, words):
    _, ours, _, _ = case
    write_peft_dir(tmp_path / "bad", config, tensors)
    with pytest.raises(AdapterError, match=words):
        read_adapter("bad", tmp_path / "bad", ours.config)


def test_an_adapter_past_the_largest_rank_is_refused(case):
    _, ours, adapter_dir, _ = case
    with pytest.raises(AdapterError, match="past --max-lora-rank 4"):
        read_adapter("big", adapter_dir, ours.config, max_rank=4)


def test_a_gguf_lora_for_another_family_is_refused(case, tmp_path):
    peft_model, ours, _, _ = case
    other = "qwen2" if ours.config.architecture == "llama" else "llama"
    write_gguf_lora(peft_model, tmp_path / "x.gguf", other, 8, 2)
    with pytest.raises(AdapterError, match=f"made for a {other} model"):
        read_adapter("x", tmp_path / "x.gguf", ours.config)


def test_a_quantised_base_on_the_c_decoder_layer_adds_the_update_there(tmp_path):
    """w4a8 in bfloat16 runs every layer on the C decoder layer, which adds the adapter
    rows' update itself (model/native/lora_update.c): its logits match the PyTorch layers
    with the hooks (the reference) on the same A and B (the C layer's are bf16, so the
    reference's fp32 stacks are rounded to bf16 for that comparison: it checks the C
    update, not bf16's rounding), base rows beside adapter rows keep the C layer's bits
    alone, an adapter row's do not depend on its neighbours, and the adapter's effect
    follows PEFT's (float32, unrounded) one."""
    hf = make_tiny_llama(tmp_path / "base")
    write_tiny_tokenizer(tmp_path / "base")
    peft_model = make_adapter(hf, tmp_path / "adapter", 8)
    ours = load_model(tmp_path / "base", dtype="bfloat16", quantization="w4a8", progress=False)
    layers = ours.model.layers
    assert all(layer.native is not None for layer in layers)
    # A wider rank than the adapter's, in the second slot: the padding must not count.
    slots = LoraSlots(ours.config, max_loras=2, max_rank=16, device="cpu")
    attach_lora(ours.model, slots)
    assert all(layer.native.lora for layer in layers)
    adapter = read_adapter("a", tmp_path / "adapter", ours.config)
    slots.load(1, adapter)
    # The C layer's bf16 A and B^T written as an adapter loads are those taken from the
    # stacks after it loaded.
    later = LoraSlots(ours.config, max_loras=2, max_rank=16, device="cpu")
    later.load(1, adapter)
    later.use_transposed()
    assert all(torch.equal(later.bt[key], bt) for key, bt in slots.bt.items())
    assert all(torch.equal(later.a16[key], a) for key, a in slots.a16.items())
    assert all(a.dtype == torch.bfloat16 for a in (*slots.a16.values(), *slots.bt.values()))
    assert torch.equal(later.blocks, slots.blocks)
    base_alone = mixed_logits(ours, [-1, -1, -1])
    got = mixed_logits(ours, [1, -1, 1])
    assert torch.equal(got[1], base_alone[1])
    assert torch.equal(mixed_logits(ours, [1, 1, -1])[0], got[0])
    # Beside another slot's rows, the update reads the stacks rather than the slot's block.
    slots.load(0, adapter)
    assert torch.equal(mixed_logits(ours, [1, 0, -1])[0], got[0])
    slots.clear(0)
    for stack in (*slots.a.values(), *slots.b.values()):
        stack.copy_(stack.to(torch.bfloat16))  # the values the C layer holds
    for layer in layers:
        layer.native.lora = False  # the PyTorch layers, through the hooks
    reference = mixed_logits(ours, [1, -1, 1])
    for layer in layers:
        layer.native.lora = True
    for index in (0, 2):
        assert (got[index] - reference[index]).abs().max().item() < 0.05
        ours_effect = (got[index] - base_alone[index]).flatten()
        assert ours_effect.abs().max().item() > 0.5
        ids = PROMPTS[index]
        want = peft_logits(peft_model, ids, True) - peft_logits(peft_model, ids, False)
        cosine = torch.nn.functional.cosine_similarity(ours_effect, want.flatten(), dim=0)
        assert cosine > 0.9, cosine


def test_the_triton_update_matches_the_grouped_products(case):
    """The CUDA kernels (under Triton's interpreter without a GPU) against the PyTorch
    grouping, on a mixed batch, through the same slots."""
    pytest.importorskip("triton")
    from model.lora.triton_update import lora_update

    _, ours, adapter_dir, gguf_path = case
    reference = LoraSlots(ours.config, max_loras=2, max_rank=16, device="cpu")
    kernel = LoraSlots(ours.config, max_loras=2, max_rank=16, device="cpu", kernel=lora_update)
    for slots in (reference, kernel):
        slots.load(0, read_adapter("a", adapter_dir, ours.config))
        slots.load(1, read_adapter("b", gguf_path or adapter_dir, ours.config))
        slots.begin([1, -1, 0], [3, 2, 4], torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for fused in ("qkv_proj", "down_proj"):
        n_in = reference.a[0, fused].shape[2]
        n_out = reference.b[0, fused].shape[1]
        x = torch.randn(9, n_in, generator=g)
        base = torch.randn(9, n_out, generator=g)
        want, got = base.clone(), base.clone()
        reference.apply(0, fused, x, want)
        kernel.apply(0, fused, x, got)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[3:5], base[3:5])  # the base rows are untouched
        assert not torch.allclose(got[:3], base[:3])

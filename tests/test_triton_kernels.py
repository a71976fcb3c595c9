"""Each Triton kernel of the `triton_paged` backend against its plain-PyTorch twin, in
fp32. Without a GPU the kernels run on CPU tensors under Triton's interpreter (conftest
sets TRITON_INTERPRET=1), which executes the same source the GPU would compile.

Tolerance: rtol = atol = 1e-5 in fp32 (online softmax and split merging reorder sums).
An int8 cache (model/network/kv_int8.py) is written bit for bit as `quantize` writes it and
read against the twins over its dequantised values, on one case of each sliding-window test
(the interpreter is slow)."""

import pytest
import torch

pytest.importorskip("triton")

from model.attention.kernels.decode import paged_decode, paged_decode_reference  # noqa: E402
from model.attention.kernels.kv_write import kv_write, kv_write_reference  # noqa: E402
from model.attention.kernels.prefill import paged_prefill, paged_prefill_reference  # noqa: E402
from model.network.kv_int8 import quantize  # noqa: E402

TOL = {"rtol": 1e-5, "atol": 1e-5}
N_KV = 2


def _caches(
    num_blocks: int, block_size: int, head_dim: int, device: str, seed: int, int8: bool = False
):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, N_KV, head_dim)
    k = torch.randn(shape, generator=g)
    v = torch.randn(shape, generator=g)
    if int8:
        k, v = quantize(k), quantize(v)
    return k.to(device), v.to(device)


def _tables(lengths: list[int], block_size: int, num_blocks: int, seed: int) -> torch.Tensor:
    """Distinct, shuffled blocks per sequence; short rows padded with the last block (a
    kernel that read past a sequence's length would pick up its values)."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks - 1, generator=g).tolist()
    width = max(-(-n // block_size) for n in lengths)
    rows, used = [], 0
    for n in lengths:
        count = -(-n // block_size)
        rows.append(order[used : used + count] + [num_blocks - 1] * (width - count))
        used += count
    return torch.tensor(rows, dtype=torch.int64)


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
def test_kv_write_matches_twin(device: str, int8: bool) -> None:
    block_size, head_dim, num_blocks = 16, 64, 6
    k_cache, v_cache = _caches(num_blocks, block_size, head_dim, device, 0, int8)
    k_twin, v_twin = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([0, 15, 16, 17, 40, 95], device=device)
    # Rows of a fused projection: K/V are strided views, as the model hands them over.
    fused = torch.randn(len(slots), 3, N_KV, head_dim, device=device)
    k, v = fused[:, 1], fused[:, 2]
    kv_write(k, v, k_cache, v_cache, slots)
    kv_write_reference(k, v, k_twin, v_twin, slots)
    assert torch.equal(k_cache, k_twin) and torch.equal(v_cache, v_twin)
    assert not torch.equal(k_cache, _caches(num_blocks, block_size, head_dim, device, 0, int8)[0])


# Every GQA ratio with both head sizes, both block sizes and split-K on and off, each pair
# of the latter three met at least once (the interpreter is slow: no full product).
COVERING = [
    (1, 64, 16, False),
    (1, 128, 32, True),
    (3, 64, 32, True),
    (3, 128, 16, False),
    (4, 64, 16, True),
    (4, 128, 32, False),
    (8, 64, 32, False),
    (8, 128, 16, True),
]


@pytest.mark.parametrize(("n_rep", "head_dim", "block_size", "split"), COVERING)
def test_paged_decode_matches_twin(
    n_rep: int, head_dim: int, block_size: int, split: bool, device: str
) -> None:
    lengths = [1, block_size, block_size + 1, 3 * block_size - 1, 2 * block_size]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 2
    k_cache, v_cache = _caches(num_blocks, block_size, head_dim, device, n_rep)
    tables = _tables(lengths, block_size, num_blocks, n_rep).to(device)
    n_heads = N_KV * n_rep
    # The decode rows sit among other tokens of the step, in no particular order.
    q = torch.randn(9, n_heads, head_dim, device=device)
    token_index = torch.tensor([7, 0, 3, 8, 5], device=device)
    seq_lens = torch.tensor(lengths, device=device)
    out = torch.full_like(q, 7.0)
    expected = out.clone()
    scale = head_dim**-0.5
    blocks_per_split = 1 if split else 64
    paged_decode(q, k_cache, v_cache, tables, seq_lens, token_index, out, scale, blocks_per_split)
    paged_decode_reference(q, k_cache, v_cache, tables, seq_lens, token_index, expected, scale)
    torch.testing.assert_close(out, expected, **TOL)
    untouched = torch.tensor([1, 2, 4, 6])
    assert torch.all(out[untouched] == 7.0)


@pytest.mark.parametrize(("n_rep", "head_dim", "block_size"), [c[:3] for c in COVERING])
def test_paged_prefill_matches_twin(
    n_rep: int, head_dim: int, block_size: int, device: str
) -> None:
    # (cached prefix, new tokens): a fresh prompt, one longer than a tile, chunks after a
    # prefix ending mid-block and on a block boundary, and a single new token.
    shapes = [
        (0, 5),
        (0, 2 * block_size + 3),
        (block_size + 3, 17),
        (block_size, block_size),
        (7, 1),
    ]
    lengths = [p + n for p, n in shapes]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 2
    k_cache, v_cache = _caches(num_blocks, block_size, head_dim, device, 10 + n_rep)
    tables = _tables(lengths, block_size, num_blocks, n_rep).to(device)
    n_heads = N_KV * n_rep
    query_lens = [n for _, n in shapes]
    starts = [sum(query_lens[:i]) for i in range(len(shapes))]
    q = torch.randn(sum(query_lens), n_heads, head_dim, device=device)
    out = torch.full_like(q, 7.0)
    expected = out.clone()
    args = (
        tables,
        torch.tensor(lengths, device=device),
        torch.tensor(starts, device=device),
        torch.tensor(query_lens, device=device),
    )
    scale = head_dim**-0.5
    paged_prefill(q, k_cache, v_cache, *args, max(query_lens), out, scale)
    paged_prefill_reference(q, k_cache, v_cache, *args, expected, scale)
    torch.testing.assert_close(out, expected, **TOL)


# Sliding windows (Gemma 3, Mistral): one that ends mid-block, over the sequences above,
# some shorter than it; split-K on, so some splits lie wholly before a window.
# The last, on an int8 cache.
WINDOWED = [
    (1, 64, 16, True, False),
    (4, 128, 32, True, False),
    (3, 64, 16, False, False),
    (3, 64, 16, True, True),
]


@pytest.mark.parametrize(("n_rep", "head_dim", "block_size", "split", "int8"), WINDOWED)
def test_paged_decode_masks_a_sliding_window(
    n_rep: int, head_dim: int, block_size: int, split: bool, int8: bool, device: str
) -> None:
    lengths = [1, block_size + 1, 3 * block_size - 1, 5 * block_size + 3]
    window = block_size + 5
    num_blocks = sum(-(-n // block_size) for n in lengths) + 2
    k_cache, v_cache = _caches(num_blocks, block_size, head_dim, device, 20 + n_rep, int8)
    tables = _tables(lengths, block_size, num_blocks, n_rep).to(device)
    q = torch.randn(len(lengths), N_KV * n_rep, head_dim, device=device)
    token_index = torch.arange(len(lengths), device=device)
    seq_lens = torch.tensor(lengths, device=device)
    args = (q, k_cache, v_cache, tables, seq_lens, token_index)
    out, expected, unwindowed = (torch.zeros_like(q) for _ in range(3))
    scale = head_dim**-0.5
    paged_decode(*args, out, scale, 1 if split else 64, window)
    paged_decode_reference(*args, expected, scale, window)
    paged_decode_reference(*args, unwindowed, scale)
    torch.testing.assert_close(out, expected, **TOL)
    # Shorter than the window: all of it seen; longer: the window changes the result.
    torch.testing.assert_close(out[:2], unwindowed[:2], **TOL)
    assert not torch.allclose(out[2:], unwindowed[2:], **TOL)


@pytest.mark.parametrize(
    ("n_rep", "head_dim", "block_size", "int8"), [(*c[:3], c[4]) for c in WINDOWED]
)
def test_paged_prefill_masks_a_sliding_window(
    n_rep: int, head_dim: int, block_size: int, int8: bool, device: str
) -> None:
    # (cached prefix, new tokens): a prompt longer than the window, a chunk after a prefix
    # longer than it, and one token after a prefix.
    shapes = [(0, 3 * block_size + 3), (2 * block_size + 3, 17), (4 * block_size, 1)]
    window = block_size + 5
    lengths = [p + n for p, n in shapes]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 2
    k_cache, v_cache = _caches(num_blocks, block_size, head_dim, device, 30 + n_rep, int8)
    tables = _tables(lengths, block_size, num_blocks, n_rep).to(device)
    query_lens = [n for _, n in shapes]
    starts = [sum(query_lens[:i]) for i in range(len(shapes))]
    q = torch.randn(sum(query_lens), N_KV * n_rep, head_dim, device=device)
    args = (
        tables,
        torch.tensor(lengths, device=device),
        torch.tensor(starts, device=device),
        torch.tensor(query_lens, device=device),
    )
    out, expected, unwindowed = (torch.zeros_like(q) for _ in range(3))
    scale = head_dim**-0.5
    paged_prefill(q, k_cache, v_cache, *args, max(query_lens), out, scale, window)
    paged_prefill_reference(q, k_cache, v_cache, *args, expected, scale, window)
    paged_prefill_reference(q, k_cache, v_cache, *args, unwindowed, scale)
    torch.testing.assert_close(out, expected, **TOL)
    assert not torch.allclose(out, unwindowed, **TOL)


@pytest.mark.parametrize("split", [True, False])
def test_attention_sinks_join_the_denominator(split: bool, device: str) -> None:
    """gpt-oss's sink logit per query head, with a window: in the decode kernel (at the end
    of its only split, or where the splits merge) and in the prefill kernel, as the twins
    add it, and changing the result."""
    n_rep, head_dim, block_size, window = 4, 64, 16, 21
    lengths = [1, block_size + 1, 5 * block_size + 3]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 2
    k_cache, v_cache = _caches(num_blocks, block_size, head_dim, device, 40)
    tables = _tables(lengths, block_size, num_blocks, 4).to(device)
    q = torch.randn(len(lengths), N_KV * n_rep, head_dim, device=device)
    sinks = 2 * torch.randn(N_KV * n_rep, device=device)
    seq_lens = torch.tensor(lengths, device=device)
    args = (q, k_cache, v_cache, tables, seq_lens, torch.arange(len(lengths), device=device))
    out, expected, sinkless = (torch.zeros_like(q) for _ in range(3))
    scale = head_dim**-0.5
    paged_decode(*args, out, scale, 1 if split else 64, window, sinks)
    paged_decode_reference(*args, expected, scale, window, sinks)
    paged_decode_reference(*args, sinkless, scale, window)
    torch.testing.assert_close(out, expected, **TOL)
    assert not torch.allclose(out, sinkless, **TOL)
    if split:
        return
    # The same sequences as prefills of 3 new tokens each.
    starts = torch.tensor([0, 1, 4], device=device)
    query_lens = torch.tensor([1, 3, 3], device=device)
    q = torch.randn(7, N_KV * n_rep, head_dim, device=device)
    prefill = (tables, seq_lens, starts, query_lens)
    out, expected = torch.zeros_like(q), torch.zeros_like(q)
    paged_prefill(q, k_cache, v_cache, *prefill, 3, out, scale, window, sinks)
    paged_prefill_reference(q, k_cache, v_cache, *prefill, expected, scale, window, sinks)
    torch.testing.assert_close(out, expected, **TOL)

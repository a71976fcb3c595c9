"""The C decoder layer's LoRA update (model/native/lora_update.c) at every instruction level,
against PyTorch's grouped products over the padded, block-diagonal stacks (what
model/lora/slots.py's `apply` computes) on the same bf16-rounded A and B the C layer holds:
adapter rows within bf16's rounding of it, base rows untouched, each adapter row the same bits
alone (its slot's own block read) as beside others (the stacks read)."""

import contextlib
import ctypes
from collections.abc import Iterator

import pytest
import torch

from model.native.lora import NativeLoraStep
from tests.native_builds import ISAS, library_at

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# A row width and target widths off the kernel's 16 lanes and 256-column blocks, ranks below
# the padded one (and an empty slot), enough weights to share the work among threads.
K, SIZES, MAX_RANK, RANKS = 603, [300, 64, 50], 16, [5, 0, 16]
ROW_SLOTS = [2, -1, 0, 2, 0, -1, 2]


@pytest.fixture(scope="module")
def stacks():
    g = torch.Generator().manual_seed(0)
    slots, width, n_out = len(RANKS), len(SIZES) * MAX_RANK, sum(SIZES)
    a = torch.zeros(slots, width, K)
    b = torch.zeros(slots, n_out, width)  # block-diagonal, as slots.py stacks it
    bt = torch.zeros(slots, MAX_RANK, n_out, dtype=torch.bfloat16)
    for s, rank in enumerate(RANKS):
        start = 0
        for t, size in enumerate(SIZES):
            # bf16 values held in fp32: the reference's products are on what the C layer reads.
            a_rows = (torch.randn(rank, K, generator=g) / 8).to(torch.bfloat16).float()
            a[s, t * MAX_RANK : t * MAX_RANK + rank] = a_rows
            block = (torch.randn(size, rank, generator=g) / 4).to(torch.bfloat16).float()
            b[s, start : start + size, t * MAX_RANK : t * MAX_RANK + rank] = block
            bt[s, :rank, start : start + size] = block.T
            start += size
    x = torch.randn(len(ROW_SLOTS), K, generator=g).to(torch.bfloat16)
    y = torch.randn(len(ROW_SLOTS), n_out, generator=g).to(torch.bfloat16)
    return a, b, bt, x, y


def slot_blocks(stacks) -> torch.Tensor:
    """Each slot's A then B^T in one block, after some other projection's copies (OFFSET
    elements), as model/lora/slots.py lays them out."""
    a, _, bt, _, _ = stacks
    a16 = a.to(torch.bfloat16).flatten(1)
    return torch.cat([torch.full((len(RANKS), OFFSET), 7.0).bfloat16(), a16, bt.flatten(1)], 1)


OFFSET = 40


def c_update(isa: str, stacks, rows: list[int], blocks: torch.Tensor | None = None) -> torch.Tensor:
    a, _, bt, x, y = stacks
    function = library_at(isa).lora_update
    function.argtypes = [_PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64]
    blocks = slot_blocks(stacks) if blocks is None else blocks
    step = NativeLoraStep(torch.tensor(RANKS), MAX_RANK, blocks)
    step.begin(torch.tensor([ROW_SLOTS[r] for r in rows]))
    sizes = torch.tensor(SIZES)
    xs, out = x[rows].contiguous(), y[rows].contiguous()
    a16 = a.to(torch.bfloat16)  # exact: every value of `a` is a bf16
    status = function(
        step.pointer, a16.data_ptr(), bt.data_ptr(), OFFSET, len(SIZES), sizes.data_ptr(),
        xs.data_ptr(), K, out.data_ptr(), len(rows), out.shape[1], K,
    )  # fmt: skip
    assert status == 0
    return out


@pytest.mark.parametrize("isa", ISAS)
def test_the_update_matches_the_grouped_products(isa, stacks):
    a, b, _, x, y = stacks
    rows = list(range(len(ROW_SLOTS)))
    got = c_update(isa, stacks, rows)
    for r, slot in enumerate(ROW_SLOTS):
        if slot < 0:
            assert torch.equal(got[r], y[r])
            continue
        delta = (x[r].float() @ a[slot].T) @ b[slot].T
        want = (y[r].float() + delta.to(torch.bfloat16).float()).to(torch.bfloat16)
        torch.testing.assert_close(got[r].float(), want.float(), rtol=1e-2, atol=1e-2)
        assert (got[r] != want).float().mean() < 0.05  # most bits agree
        assert not torch.equal(got[r], y[r]) or RANKS[slot] == 0
        assert torch.equal(c_update(isa, stacks, [r])[0], got[r])


@pytest.mark.parametrize("isa", ISAS)
def test_a_chunks_rows_are_each_the_same_bits_as_alone(isa, stacks):
    # Slot 2's 15 rows and slot 0's 5: each copy of a row lands at another place in the
    # kernel's blocks of rows or past them, and 20 adapter rows take a region of their own
    # (two threads where the OpenMP runtime lets the test choose).
    rows = [0, 1, 2, 3, 6] * 4
    alone = torch.stack([c_update(isa, stacks, [r])[0] for r in rows[:5]])
    with omp_threads(2):
        got = c_update(isa, stacks, rows)
    assert torch.equal(got, alone.repeat(4, 1))


@contextlib.contextmanager
def omp_threads(count: int) -> Iterator[None]:
    """The kernels' OpenMP team at `count` threads, when their runtime is libgomp."""
    try:
        openmp = ctypes.CDLL("libgomp.so.1")  # the library's own OpenMP runtime, loaded
    except OSError:
        yield
        return
    threads = openmp.omp_get_max_threads()
    openmp.omp_set_num_threads(count)
    try:
        yield
    finally:
        openmp.omp_set_num_threads(threads)


@pytest.mark.parametrize("isa", ISAS)
def test_rows_of_one_slot_read_its_block_and_of_several_the_stacks(isa, stacks):
    _, _, _, _, y = stacks
    zeros = torch.zeros_like(slot_blocks(stacks))
    # Rows of slot 2 alone (with a base row): read from the (zeroed) block, left unchanged.
    assert torch.equal(c_update(isa, stacks, [0, 1, 3], zeros), y[[0, 1, 3]])
    # Beside slot 0's rows: read from the stacks, the same bits as with the true block.
    assert torch.equal(c_update(isa, stacks, [0, 2], zeros), c_update(isa, stacks, [0, 2]))


# int4's tiles of 16 columns: target widths that cut across them and the threads' shares.
K4, SIZES4 = 96, [80, 32, 48]


def int4_case(isa: str, rows: list[int], fused: bool) -> torch.Tensor:
    """An int4 product then the update: lora_int4_matmul in one call (`fused`), or
    int4_matmul then lora_update."""
    from model.native.ops import NativeInt4Matmul

    g = torch.Generator().manual_seed(1)
    n_out, width = sum(SIZES4), len(SIZES4) * MAX_RANK
    q = torch.randint(0, 16, (n_out, K4), generator=g, dtype=torch.uint8)
    scales = (torch.rand(K4 // 32, n_out, 2, generator=g) / 8).to(torch.bfloat16)
    w4, sz4 = NativeInt4Matmul.pack(q, scales)
    a = (torch.randn(len(RANKS), width, K4, generator=g) / 8).to(torch.bfloat16)
    bt = (torch.randn(len(RANKS), MAX_RANK, n_out, generator=g) / 4).to(torch.bfloat16)
    blocks = torch.cat([torch.zeros(len(RANKS), OFFSET).bfloat16(), a.flatten(1), bt.flatten(1)], 1)
    step = NativeLoraStep(torch.tensor(RANKS), MAX_RANK, blocks)
    step.begin(torch.tensor([(ROW_SLOTS * 3)[r] for r in rows]))
    x = torch.randn(len(rows), K4, generator=g).to(torch.bfloat16)
    y, sizes = torch.empty(len(rows), n_out, dtype=torch.bfloat16), torch.tensor(SIZES4)
    library = library_at(isa)
    head = (step.pointer, a.data_ptr(), bt.data_ptr(), OFFSET, len(SIZES4), sizes.data_ptr())
    if fused:
        function = library.lora_int4_matmul
        function.argtypes = [_PTR, _PTR, _PTR, _I64, _I64, _PTR] + [_PTR, _I64, _PTR, _PTR]
        function.argtypes += [_PTR, _I64, _I64, _I64]
        tail = (y.data_ptr(), len(rows), n_out, K4)
        assert function(*head, x.data_ptr(), K4, w4.data_ptr(), sz4.data_ptr(), *tail) == 0
        return y
    product = library.int4_matmul_bf16
    product.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64]
    weights = (w4.data_ptr(), sz4.data_ptr())
    assert product(x.data_ptr(), K4, *weights, y.data_ptr(), len(rows), n_out, K4) == 0
    function = library.lora_update
    function.argtypes = [_PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64]
    assert function(*head, x.data_ptr(), K4, y.data_ptr(), len(rows), n_out, K4) == 0
    return y


@pytest.mark.parametrize("isa", ISAS)
def test_the_update_inside_the_int4_product_is_the_same_bits(isa):
    # Two threads (a team of one keeps the update apart), each expanding its own tiles'
    # columns: three slots and base rows (the stacks), one slot's rows (its block), and past
    # the rows the product's region takes the update into (after it, on its own).
    library_at(isa)
    try:
        openmp = ctypes.CDLL("libgomp.so.1")  # the library's own OpenMP runtime, loaded
    except OSError:
        pytest.skip("the kernels' OpenMP runtime is not libgomp")
    threads = openmp.omp_get_max_threads()
    openmp.omp_set_num_threads(2)
    try:
        for rows in (list(range(7)), [0, 1, 3], list(range(17))):
            fused, apart = int4_case(isa, rows, True), int4_case(isa, rows, False)
            assert torch.equal(fused, apart)
    finally:
        openmp.omp_set_num_threads(threads)

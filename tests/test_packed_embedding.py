"""A quantised, untied GGUF embedding stays in the file's blocks
(model/checkpoint/packed_embedding.py):
the rows it looks up equal the `gguf` package's own dequantisation of the whole table, and
the model's logits equal those of the same weights loaded as a dense table."""

import gc
import os
import time

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from model.checkpoint.gguf import GGUFCheckpoint
from model.checkpoint.packed_embedding import PackedEmbedding
from model.loader import load_model
from model.network.batch import Batch
from model.network.paged_cache import PagedKVCache
from tests.residency import resident_pages
from tests.tiny_families import make_tiny, write_gguf


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q8_0])
def test_rows_equal_the_dequantised_table(tmp_path, qtype, monkeypatch) -> None:
    hf = make_tiny("qwen3", tmp_path)  # an untied output projection
    path = write_gguf(
        hf, "qwen3", tmp_path, tmp_path / "e.gguf", types={"token_embd.weight": qtype}
    )
    model = load_model(path, dtype=torch.float32, progress=False).model
    assert isinstance(model.embed_tokens, PackedEmbedding)
    stored = next(t for t in GGUFReader(path).tensors if t.name == "token_embd.weight")
    table = torch.from_numpy(dequantize(stored.data, qtype).copy()).reshape(512, -1)
    ids = torch.tensor([[0, 5, 511], [7, 7, 100]])
    assert torch.equal(model.embed_tokens(ids), table[ids])

    # The same file with the table dequantised whole at load gives the same logits.
    monkeypatch.setattr(GGUFCheckpoint, "packed_embedding", lambda self, dtype: None)
    dense = load_model(path, dtype=torch.float32, progress=False).model
    assert isinstance(dense.embed_tokens, torch.nn.Embedding)
    prompt = [3, 99, 250, 7, 7, 42]
    logits = []
    for m in (model, dense):
        cache = PagedKVCache.allocate(m.config, 4, 16)
        logits.append(m(Batch.build([prompt], [0], [[0]], 16, "cpu", all_logits=True), cache))
    assert torch.equal(*logits)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise")
def test_the_table_is_read_ahead_at_load(tmp_path) -> None:
    """A row read from disk in a decode step held the step for tens to hundreds of ms: the
    table's pages are in the page cache once it is built, before any row is looked up."""
    hf = make_tiny("qwen3", tmp_path)
    path = write_gguf(
        hf,
        "qwen3",
        tmp_path,
        tmp_path / "e.gguf",
        types={"token_embd.weight": GGMLQuantizationType.Q8_0},
    )
    reader = GGUFReader(path)
    stored = next(t for t in reader.tensors if t.name == "token_embd.weight")
    offset, dim = int(stored.data_offset), int(stored.shape[0])
    del reader, stored  # its memory map would keep the file's pages cached
    gc.collect()
    with open(path, "rb") as f:  # the file's clean pages out of the page cache
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    embedding = PackedEmbedding(path, offset, 512, dim, GGMLQuantizationType.Q8_0, torch.float32)
    table = embedding.table
    deadline = time.monotonic() + 5  # the read-ahead runs in the background
    while not all(resident := resident_pages(table.data_ptr(), table.nbytes)):
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert all(resident), f"{resident.count(False)} of {len(resident)} pages not resident"


def random_blocks(qtype: GGMLQuantizationType, rows: int, dim: int) -> np.ndarray:
    """Random blocks of `qtype` whose float16 scales are finite: [rows, row bytes] uint8."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    data = rng.integers(0, 256, (rows * dim // block, type_size), dtype=np.uint8)
    scales = rng.uniform(-2e-2, 2e-2, (data.shape[0], 2)).astype(np.float16)
    # Where each type keeps its float16 fields: Q6_K's d comes last, the others' first.
    two = (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K)
    offsets = (
        [type_size - 2] if qtype == GGMLQuantizationType.Q6_K else [0, 2] if qtype in two else [0]
    )
    for i, at in enumerate(offsets):
        data[:, at : at + 2] = scales[:, i : i + 1].view(np.uint8)
    return data.reshape(rows, -1)


@pytest.mark.parametrize(
    "qtype",
    [getattr(GGMLQuantizationType, t) for t in ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K")],
    ids=lambda t: t.name,
)
def test_rows_in_one_c_call_equal_the_gguf_dequantisation(tmp_path, qtype) -> None:
    """The C lookup of a step's rows (model/native/gguf_rows.c), in fp32 and in bf16."""
    rows, dim = 40, 512
    data = random_blocks(qtype, rows, dim)
    path = tmp_path / "table.bin"
    path.write_bytes(b"\0" * 64 + data.tobytes())  # the table at an offset, as in a file
    table = torch.from_numpy(dequantize(data, qtype).copy()).reshape(rows, dim)
    ids = torch.tensor([[0, 39, 7], [7, 12, 1]])
    for dtype in (torch.float32, torch.bfloat16):
        embedding = PackedEmbedding(path, 64, rows, dim, qtype, dtype)
        assert embedding._native is not None
        assert torch.equal(embedding(ids), table[ids].to(dtype))
    with pytest.raises(IndexError):
        embedding(torch.tensor([rows]))

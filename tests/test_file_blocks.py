"""GGUF blocks handed to quantised layers as they are (model/checkpoint/file_blocks.py),
against the `gguf` package's dequantisation: the integers and scales read from the bytes
give back its values exactly, a layer filled from blocks computes what the same layer
filled from its floats does, the loader hands them over, and the default model's tensors
come out the same either way (Q and K reordered as bytes)."""

from collections.abc import Iterable, Iterator

import gguf.quants
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from model.checkpoint import open_checkpoint
from model.checkpoint.default_model import default_model_path
from model.checkpoint.dequant import q4_grid, q5_0_grid, q6_k_grid, q8_0_grid
from model.checkpoint.file_blocks import LAYER_BLOCK_TYPES, FileBlocks
from model.checkpoint.gguf_weights import count_gguf_tensors, iter_gguf_weights
from model.checkpoint.mxfp4 import decode_blocks
from model.loader import load_model
from model.network.llama import Llama
from model.quant.factory import quantized_linear
from tests.test_dequant import F16_FIELDS, random_blocks

# The layer format that holds each block type as it is.
FORMAT = {T.Q4_0: "int4", T.Q4_1: "int4", T.Q4_K: "int4", T.Q5_0: "int5", T.Q6_K: "int6"}
FORMAT[T.Q8_0], FORMAT[T.MXFP4] = "int8g", "mxfp4"
TYPES = sorted(LAYER_BLOCK_TYPES, key=lambda t: t.value)


def grid_values(blocks: torch.Tensor, qtype: T) -> torch.Tensor:
    """Each weight from the grid the block type states, [n_blocks, weights a block]."""
    if qtype == T.MXFP4:  # held as it is: its values are its decoding's
        return decode_blocks(blocks)
    if qtype == T.Q8_0:
        q, d = q8_0_grid(blocks)
        return q.float() * d.float()
    if qtype == T.Q5_0:
        q, d = q5_0_grid(blocks)
        return (q.float() - 16) * d.float()
    if qtype == T.Q6_K:
        q, c, d = q6_k_grid(blocks)
        scale = (d * c.float()).repeat_interleave(16, dim=1)
        return (q.float() - 32) * scale
    q, step, low = q4_grid(blocks, qtype)
    return (q.float() * step + low).reshape(len(blocks), -1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_grids_give_the_reference_values(qtype: T) -> None:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    data = random_blocks(qtype, rows=5, blocks_per_row=1024 // block_size)
    reference = gguf.quants.dequantize(data, qtype)
    assert np.isfinite(reference).all()
    blocks = torch.from_numpy(data).reshape(-1, type_size)
    # Equal values (Q4_0's 8 d - 8 d is +0 where the reference's 0 d may be -0).
    ours = grid_values(blocks, qtype).reshape(reference.shape)
    assert torch.equal(ours, torch.from_numpy(reference.astype(np.float32)))


def file_like_blocks(qtype: T, rows: int, width: int) -> np.ndarray:
    """Random blocks with the scales of a trained layer's (0.1% to 1% per step, either
    sign where the type has one), not the float16 range."""
    data = random_blocks(qtype, rows, width // GGML_QUANT_SIZES[qtype][0])
    rng = np.random.default_rng(7)
    blocks = data.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    for offset in F16_FIELDS[qtype]:
        scale = rng.uniform(1e-3, 1e-2, len(blocks)) * rng.choice([-1, 1], len(blocks))
        if qtype == T.Q4_K:  # its d and dmin multiply unsigned 6-bit scales and mins
            scale = np.abs(scale) / 32
        blocks[:, offset : offset + 2] = scale.astype("<f2").view(np.uint8).reshape(-1, 2)
    if qtype == T.MXFP4:  # E8M0 scales 2^-10 to 2^-6
        blocks[:, 0] = rng.integers(117, 122, len(blocks))
    return data


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_layer_filled_from_blocks_computes_as_from_their_values(qtype: T) -> None:
    rows, width = 48, 512
    data = file_like_blocks(qtype, rows, width)
    weight = torch.from_numpy(gguf.quants.dequantize(data, qtype).copy())
    raw = torch.from_numpy(data)
    from_blocks = quantized_linear(FORMAT[qtype], width, rows, "cpu")
    # In two parts, out of order, as row blocks of a fused layer may come.
    from_blocks.load_rows(16, FileBlocks(raw[16:], qtype, width, torch.float32))
    from_blocks.load_rows(0, FileBlocks(raw[:16], qtype, width, torch.float32))
    from_values = quantized_linear(FORMAT[qtype], width, rows, "cpu")
    from_values.load_rows(0, weight)
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(0)).bfloat16()
    exact = x.double() @ weight.double().T
    ours = from_blocks(x).double()
    # bf16 output and, in int4, bf16 scales and zeros: a few parts in a thousand.
    tolerance = 0.01 * exact.abs().max()
    assert (ours - exact).abs().max() <= tolerance
    assert (ours - from_values(x).double()).abs().max() <= tolerance
    if qtype in (T.Q6_K, T.Q8_0):  # exact formats, read back as a tied embedding reads them
        assert torch.equal(from_blocks.embed(torch.arange(rows), torch.float32), weight)


def whole_tensors(weights: Iterable[tuple[str, object]]) -> dict[str, torch.Tensor]:
    """Each name's blocks of rows joined, file blocks decoded."""
    parts: dict[str, list[torch.Tensor]] = {}
    for name, weight in weights:
        decoded = weight.dequantize() if isinstance(weight, FileBlocks) else weight
        parts.setdefault(name, []).append(decoded)
    return {name: torch.cat(blocks) for name, blocks in parts.items()}


def test_the_default_models_tensors_are_the_same_from_blocks() -> None:
    """Every tensor of the default model (Llama: Q and K rows reordered per head) decoded
    from the blocks the iterator hands over equals the one it decodes itself; the blocks
    come in as many parts as the progress bar counts."""
    checkpoint = open_checkpoint(default_model_path())
    gguf_file, config = checkpoint.gguf, checkpoint.config
    handed = list(
        iter_gguf_weights(gguf_file, config, torch.float32, file_blocks=LAYER_BLOCK_TYPES)
    )
    assert len(handed) == count_gguf_tensors(gguf_file, config, file_blocks=LAYER_BLOCK_TYPES)
    assert {w.qtype for _, w in handed if isinstance(w, FileBlocks)} == {T.Q4_1, T.Q8_0}
    decoded = whole_tensors(iter_gguf_weights(gguf_file, config, torch.float32))
    from_blocks = whole_tensors(handed)
    assert decoded.keys() == from_blocks.keys()
    for name, tensor in decoded.items():
        assert torch.equal(from_blocks[name], tensor), name


def test_the_loader_hands_blocks_to_quantised_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loaded in int4, the default model's Q4_1 matrices reach the model as blocks, and
    none is dequantised on the way into its int4 layers."""
    handed: list[T] = []
    decoded: list[T] = []
    load_weights, dequantize = Llama.load_weights, FileBlocks.dequantize

    def watched(self: Llama, weights: Iterable[tuple[str, object]]) -> None:
        def each() -> Iterator[tuple[str, object]]:
            for name, weight in weights:
                if isinstance(weight, FileBlocks):
                    handed.append(weight.qtype)
                yield name, weight

        load_weights(self, each())

    def counted(self: FileBlocks) -> torch.Tensor:
        decoded.append(self.qtype)
        return dequantize(self)

    monkeypatch.setattr(Llama, "load_weights", watched)
    monkeypatch.setattr(FileBlocks, "dequantize", counted)
    loaded = load_model(dtype=torch.bfloat16, quantization="int4", progress=False)
    assert handed.count(T.Q4_1) >= 7 * loaded.config.n_layers
    assert T.Q4_1 not in decoded

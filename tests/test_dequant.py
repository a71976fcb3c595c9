"""Tests for model/checkpoint/dequant.py against gguf.quants, the independent numpy reference.

Our decoders compute in float32 in the same operation order as the reference, so every
comparison here is bit-exact (tolerance 0; -0.0 and 0.0 differ). The one allowance: NaN
matches NaN whatever its payload (only random F16/BF16/F32 bytes produce NaN).
"""

import gguf
import gguf.quants
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from model.checkpoint.default_model import default_model_path
from model.checkpoint.dequant import SUPPORTED_TYPES, UnsupportedQuantType, dequantize

T = GGMLQuantizationType

# Byte offsets of the float16 scale fields in each block. Random bytes there would often be
# NaN or inf, which hides decoding errors (NaN == NaN compares equal here), so the tests
# overwrite them with random finite float16 values.
F16_FIELDS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    T.Q8_0: (0,),
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.F32: (),
    T.F16: (),
    T.BF16: (),
    T.MXFP4: (),  # its E8M0 scale byte is set below
}
# Types gguf.quants can also quantise (its K-quants are dequantise-only).
QUANTIZABLE = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.MXFP4]
# Worst relative RMS error of a quantise/dequantise round trip on Gaussian data: a sanity
# bound on the reference itself (far above what each format achieves, far below garbage).
ROUND_TRIP_RMS = {T.F32: 0.0, T.F16: 1e-3, T.BF16: 5e-3, T.Q8_0: 0.02}
ROUND_TRIP_RMS_4_5_BIT = 0.2

TYPES = sorted(SUPPORTED_TYPES, key=lambda t: t.value)


def assert_bit_equal(ours: torch.Tensor, reference: np.ndarray) -> None:
    """Every value has the same bits, except that any NaN matches any NaN: numpy, torch on
    the CPU and CUDA each keep a different part of a float16 NaN's payload and sign."""
    expected = torch.from_numpy(np.array(reference, dtype=np.float32))
    assert ours.dtype == torch.float32
    assert ours.shape == expected.shape
    same = (ours.view(torch.int32) == expected.view(torch.int32)) | (
        ours.isnan() & expected.isnan()
    )
    if not bool(same.all()):
        bad = (~same).nonzero()[0].tolist()
        raise AssertionError(
            f"{int((~same).sum())} of {same.numel()} values differ; first at {bad}: "
            f"ours {ours[tuple(bad)].item()!r}, reference {expected[tuple(bad)].item()!r}"
        )


def random_blocks(qtype: GGMLQuantizationType, rows: int, blocks_per_row: int) -> np.ndarray:
    """Random bytes [rows, bytes_per_row] with finite float16 scales, as GGUFReader gives."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(qtype.value)
    blocks = rng.integers(0, 256, size=(rows * blocks_per_row, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        bits = rng.integers(0, 1 << 16, size=blocks.shape[0], dtype=np.uint16)
        # Exponent 0x1F is inf/NaN: move those to exponent 0x1E, keeping subnormals and zeros.
        bits = np.where((bits & 0x7C00) == 0x7C00, bits & ~np.uint16(0x0400), bits)
        blocks[:, offset : offset + 2] = bits.astype("<u2").view(np.uint8).reshape(-1, 2)
    if qtype == T.MXFP4:  # scales 2^-127 to 2^124: subnormal to near fp32's largest, finite
        blocks[:, 0] = rng.integers(0, 252, size=blocks.shape[0], dtype=np.uint8)
    return blocks.reshape(rows, blocks_per_row * type_size)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_random_blocks_match_reference(qtype: GGMLQuantizationType) -> None:
    block_size, _ = GGML_QUANT_SIZES[qtype]
    blocks_per_row = 3 if block_size == 256 else (24 if block_size == 32 else 96)
    data = random_blocks(qtype, rows=5, blocks_per_row=blocks_per_row)
    reference = gguf.quants.dequantize(data, qtype)
    shape = (5, blocks_per_row * block_size)
    ours = dequantize(torch.from_numpy(data), qtype, shape)
    # Plain float bytes include NaN and inf, which must pass through; quantised blocks with
    # finite scales must decode to finite values, or the comparison proves little.
    if qtype not in (T.F32, T.F16, T.BF16):
        assert np.isfinite(reference).all()
    assert_bit_equal(ours, reference)


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_gaussian_data_round_trips(qtype: GGMLQuantizationType) -> None:
    rng = np.random.default_rng(1234)
    weights = (rng.standard_normal((16, 512)) * rng.uniform(0.01, 3.0, (16, 1))).astype(np.float32)
    data = gguf.quants.quantize(weights, qtype)
    # The reference hands F32/F16 back as float arrays, like GGUFReader; we take bytes.
    raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8))
    ours = dequantize(raw, qtype, weights.shape)
    assert_bit_equal(ours, gguf.quants.dequantize(data, qtype))
    rms_error = float(np.sqrt(np.mean((ours.numpy() - weights) ** 2) / np.mean(weights**2)))
    assert rms_error <= ROUND_TRIP_RMS.get(qtype, ROUND_TRIP_RMS_4_5_BIT)


def test_q4_1_hand_built_block() -> None:
    # d = 0.5, m = -1; byte j = j (low nibble) | (15 - j) (high nibble), so element j is
    # 0.5 * j - 1 and element 16 + j is 0.5 * (15 - j) - 1. Independent of gguf.quants.
    scales = np.array([0.5, -1.0], dtype="<f2").view(np.uint8)
    nibbles = np.array([j | ((15 - j) << 4) for j in range(16)], dtype=np.uint8)
    raw = torch.from_numpy(np.concatenate([scales, nibbles]))
    expected = [0.5 * j - 1 for j in range(16)] + [0.5 * (15 - j) - 1 for j in range(16)]
    assert dequantize(raw, T.Q4_1, (1, 32)).flatten().tolist() == expected


@pytest.fixture(scope="module")
def model_reader() -> gguf.GGUFReader:
    return gguf.GGUFReader(default_model_path())


MODEL_TENSORS = [
    "token_embd.weight",  # Q8_0, the largest tensor
    "blk.0.attn_q.weight",  # Q4_1, square
    "blk.0.attn_k.weight",  # Q4_1, GQA: fewer rows than columns
    "blk.0.ffn_down.weight",  # Q4_1, [576, 1536]
    "blk.29.ffn_gate.weight",  # Q4_1, last layer
    "blk.0.attn_norm.weight",  # F32 vector
    "output_norm.weight",  # F32 vector
]


@pytest.mark.parametrize("name", MODEL_TENSORS)
def test_default_model_tensor_matches_reference(model_reader: gguf.GGUFReader, name: str) -> None:
    tensor = next(t for t in model_reader.tensors if t.name == name)
    shape = tuple(reversed([int(n) for n in tensor.shape]))
    # Copy out of the read-only memory map: torch refuses to wrap non-writable arrays quietly.
    raw = torch.from_numpy(np.array(tensor.data).view(np.uint8))
    ours = dequantize(raw, tensor.tensor_type, shape)
    reference = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    assert ours.shape == shape == reference.shape
    assert bool(torch.isfinite(ours).all())
    assert_bit_equal(ours, reference)


def test_default_model_types_are_covered(model_reader: gguf.GGUFReader) -> None:
    assert {t.tensor_type for t in model_reader.tensors} <= SUPPORTED_TYPES


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q6_K, T.F32], ids=lambda t: t.name)
def test_low_precision_output_is_one_rounding_of_float32(
    qtype: GGMLQuantizationType, dtype: torch.dtype
) -> None:
    block_size, _ = GGML_QUANT_SIZES[qtype]
    data = random_blocks(qtype, rows=2, blocks_per_row=256 // block_size)
    if qtype == T.F32:
        data = np.random.default_rng(7).standard_normal((2, 256)).astype(np.float32)
    raw = torch.from_numpy(data.view(np.uint8))
    ours = dequantize(raw, qtype, (2, 256), dtype=dtype)
    assert ours.dtype == dtype and ours.shape == (2, 256)
    assert torch.equal(ours, dequantize(raw, qtype, (2, 256)).to(dtype))


def test_float_result_does_not_alias_input() -> None:
    raw = torch.from_numpy(np.arange(8, dtype=np.float32).view(np.uint8))
    out = dequantize(raw, T.F32, (2, 4))
    out.zero_()
    assert raw.view(torch.float32).tolist() == list(range(8))


@pytest.mark.parametrize("qtype", [T.IQ2_XXS, T.TQ1_0, T.Q8_K], ids=lambda t: t.name)
def test_unsupported_type_is_named(qtype: GGMLQuantizationType) -> None:
    _, type_size = GGML_QUANT_SIZES[qtype]
    with pytest.raises(UnsupportedQuantType, match=qtype.name):
        dequantize(torch.zeros(type_size, dtype=torch.uint8), qtype, (256,))
    assert issubclass(UnsupportedQuantType, ValueError)


def test_wrong_byte_count_is_rejected() -> None:
    with pytest.raises(ValueError, match="Q4_1.*needs 40 bytes, got 39"):
        dequantize(torch.zeros(39, dtype=torch.uint8), T.Q4_1, (2, 32))


def test_row_not_a_whole_number_of_blocks_is_rejected() -> None:
    # 64 elements would be exactly 2 blocks of bytes, but a 16-wide row splits a block.
    with pytest.raises(ValueError, match="multiple of its block size 32"):
        dequantize(torch.zeros(40, dtype=torch.uint8), T.Q4_1, (4, 16))


def test_non_uint8_input_is_rejected() -> None:
    with pytest.raises(TypeError, match="uint8"):
        dequantize(torch.zeros(4, dtype=torch.float32), T.F32, (4,))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_stays_on_the_input_device(qtype: GGMLQuantizationType) -> None:
    # The meta device has no data: any step that leaves torch for numpy, Python numbers or
    # the CPU fails here, so this guards the CUDA path on machines without a GPU.
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = torch.empty(2 * (512 // block_size) * type_size, dtype=torch.uint8, device="meta")
    out = dequantize(raw, qtype, (2, 512), dtype=torch.float16)
    assert (out.device.type, out.shape, out.dtype) == ("meta", (2, 512), torch.float16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_cuda_matches_cpu(qtype: GGMLQuantizationType) -> None:
    block_size, _ = GGML_QUANT_SIZES[qtype]
    raw = torch.from_numpy(random_blocks(qtype, rows=4, blocks_per_row=512 // block_size))
    on_cpu = dequantize(raw, qtype, (4, 512))
    on_cuda = dequantize(raw.cuda(), qtype, (4, 512))
    assert on_cuda.device.type == "cuda"
    assert_bit_equal(on_cuda.cpu(), on_cpu.numpy())

"""The C RMSNorm (model/native/rms_norm.c) against the model's PyTorch RMSNorm: fp32 to
rounding, bf16 within one unit in the last place, a row's result bit for bit the same
alone and in a batch (also past the row count where rows are shared among threads), at
every instruction level the machine executes; and the loader uses it exactly when the
CPU's C attention is in use."""

import os
import shutil

import pytest
import torch

from model.loader import load_model
from model.native.ops import NativeRmsNorm
from model.network.decoder_layer import RMSNorm
from tests.native_builds import ISAS
from tests.tiny_models import make_tiny_llama, write_tiny_tokenizer

if shutil.which("cc") is None and shutil.which("gcc") is None and not os.environ.get("CI"):
    pytest.skip("no C compiler to build the kernel", allow_module_level=True)


def _norms(width: int, dtype: torch.dtype) -> tuple[RMSNorm, RMSNorm]:
    reference = RMSNorm(width, 1e-5).to(dtype)
    with torch.no_grad():
        reference.weight.normal_(1.0, 0.2, generator=torch.Generator().manual_seed(1))
    native = RMSNorm(width, 1e-5).to(dtype)
    native.load_state_dict(reference.state_dict())
    native.native = NativeRmsNorm()
    return reference, native


@pytest.mark.parametrize("cpu_isa", ISAS, indirect=True)
@pytest.mark.parametrize("rows", [1, 37, 100])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.bfloat16, 2**-7)])
def test_matches_pytorch(rows: int, dtype: torch.dtype, tol: float, cpu_isa: str) -> None:
    reference, native = _norms(576, dtype)
    x = (torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)) * 3).to(dtype)
    with torch.inference_mode():
        want, got = reference(x), native(x)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("cpu_isa", ISAS, indirect=True)
def test_a_row_alone_equals_it_in_a_batch(cpu_isa: str) -> None:
    _, native = _norms(64, torch.bfloat16)
    x = torch.randn(100, 64).bfloat16()  # past the threaded row count
    with torch.inference_mode():
        batch = native(x)
        for row in (0, 63, 64, 99):
            assert torch.equal(native(x[row : row + 1].clone())[0], batch[row]), row


def test_strided_input_falls_back_to_pytorch() -> None:
    x = torch.randn(8, 128)[:, ::2]
    assert NativeRmsNorm()(x, torch.ones(64), 1e-5) is None


def test_loader_uses_it_with_the_c_attention_only(tmp_path) -> None:
    make_tiny_llama(tmp_path, heads="gqa")
    write_tiny_tokenizer(tmp_path)
    for backend, native in (("auto", True), ("torch_ref", False)):
        model = load_model(tmp_path, attention_backend=backend, progress=False).model
        assert (model.norm.native is not None) == native, backend
        assert all((layer.input_layernorm.native is not None) == native for layer in model.layers)

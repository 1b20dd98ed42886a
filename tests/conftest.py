import os

import pytest
import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)

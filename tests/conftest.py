from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One intra-op thread per test process: with several workers on few cores,
    # OpenMP threads spinning against each other make every step many times slower.
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


def dims(n_heads: int = 4, head_dim: int = 16, train_length: int = 32) -> dict[str, int]:
    return {
        "n_heads": n_heads,
        "head_dim": head_dim,
        "d_model": n_heads * head_dim,
        "train_length": train_length,
    }

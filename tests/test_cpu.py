"""CPU arithmetic: subnormal floats are flushed to zero in every thread."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT

# A fresh process (the setting must come before torch's first parallel operation):
# how many of 2^22 subnormal products stay nonzero, with torch's threads working on them.
SUBNORMAL_PRODUCTS = textwrap.dedent(
    """
    import json, sys, torch
    from worker.cpu import flush_denormals

    torch.set_num_threads(2)
    if sys.argv[1] == "flush":
        flush_denormals()
    x = torch.full((1 << 22,), 1e-30) * 1e-9  # each product is about 1e-39, subnormal
    print(json.dumps(int((x != 0).sum())))
    """
)


def subnormals_left(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", SUBNORMAL_PRODUCTS, mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_subnormals_are_flushed_in_every_thread() -> None:
    assert subnormals_left("keep") == 1 << 22  # the CPU's default keeps them
    assert subnormals_left("flush") == 0  # the main thread's share and the pool's

"""Which FlexAttention kernel options compile and run on this GPU for each kind of bias.

The second H200 run (docs/performance-history.md) found that T5, KERPLE and FIRE's
score_mods, which read a table per (query, key) pair, need more shared memory than the
default H100 tiles leave (bf16, head size 64: 128 x 128, 3 stages) and fail to compile;
ALiBi's, which reads one slope per head, fits. This probe compiles each bias form under
a ladder of kernel options, forward alone and forward + backward, and prints a JSON line
per try: whether it built and its time per call. Pure torch, no posbench import: it runs
before the suite's wheels are installed.

    python3 -m benchmarks.flex_probe [--budget-s 150] [--length 2048] [--head-dim 64]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

LADDER: dict[str, dict | None] = {
    "default": None,
    "fwd128x64": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64},
    "64x64": {
        "fwd_BLOCK_M": 64,
        "fwd_BLOCK_N": 64,
        "bwd_BLOCK_M1": 32,
        "bwd_BLOCK_N1": 64,
        "bwd_BLOCK_M2": 64,
        "bwd_BLOCK_N2": 32,
    },
    "64x64s2": {
        "fwd_BLOCK_M": 64,
        "fwd_BLOCK_N": 64,
        "num_stages": 2,
        "bwd_BLOCK_M1": 32,
        "bwd_BLOCK_N1": 64,
        "bwd_BLOCK_M2": 64,
        "bwd_BLOCK_N2": 32,
    },
    "32x32s1": {
        "fwd_BLOCK_M": 32,
        "fwd_BLOCK_N": 32,
        "num_stages": 1,
        "bwd_BLOCK_M1": 16,
        "bwd_BLOCK_N1": 32,
        "bwd_BLOCK_M2": 32,
        "bwd_BLOCK_N2": 16,
    },
}


def mods(heads: int, length: int, device: torch.device, grad: bool):
    slopes = torch.rand(heads, device=device, requires_grad=grad)
    table = torch.randn(heads, length, device=device, requires_grad=grad)
    cells = 1024
    values = torch.randn(heads, cells + 1, device=device, requires_grad=grad)
    in_cells = torch.linspace(0, cells, length, device=device)
    norm = torch.linspace(1, 2, length, device=device)

    def alibi(score, b, h, q, k):
        return score - slopes[h] * (q - k).abs()

    def t5(score, b, h, q, k):
        return score + table[h, (q - k).abs()]

    def fire(score, b, h, q, k):
        t = in_cells[(q - k).abs()] / norm[q]
        cell = t.floor().clamp(0, cells - 1).to(torch.int64)
        return score + values[h, cell] + (values[h, cell + 1] - values[h, cell]) * (t - cell)

    found = {"alibi": alibi, "t5": t5, "fire": fire}
    try:  # posbench's own bias forms, where its wheels are installed
        from worker.encodings import build
    except ImportError:
        return found
    for name in ("t5", "kerple_log", "fire"):
        enc = build(
            name, n_heads=heads, head_dim=64, d_model=64 * heads, train_length=length // 4
        ).to(device)
        bias = enc.bias_mod(length)

        def real(score, b, h, q, k, bias=bias):
            return score + bias(h, q, k)

        found[f"{name}_real"] = real
    return found


def attempt(kernel, mask, kind: str, shape: tuple, options, backward: bool) -> dict:
    """Compile and run one bias form under ``options``: whether it built, and its time."""
    device = torch.device("cuda")
    q, k, v = (
        torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=backward)
        for _ in range(3)
    )

    def step() -> None:
        # Built per step: a learned table's graph is freed by backward.
        mod = mods(shape[1], shape[2], device, backward)[kind]
        out = kernel(q, k, v, score_mod=mod, block_mask=mask, kernel_options=options)
        if backward:
            out.sum().backward()

    began = time.monotonic()
    try:
        step()
        torch.cuda.synchronize()
        compiled = time.monotonic() - began
        began = time.monotonic()
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    except Exception as exc:  # a probe reports what failed
        return {"built": False, "error": f"{type(exc).__name__}: {str(exc)[-160:]}"}
    ms = (time.monotonic() - began) / 5 * 1000
    return {"built": True, "compile_s": round(compiled, 1), "ms": round(ms, 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kinds", nargs="+", default=["t5", "fire", "alibi"])
    parser.add_argument(
        "--passes",
        nargs="+",
        type=lambda x: x == "backward",
        default=[False, True],
        help="forward and/or backward",
    )
    parser.add_argument("--levels", nargs="+", default=list(LADDER))
    args = parser.parse_args()
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    start = time.monotonic()
    device = torch.device("cuda")
    torch._dynamo.config.cache_size_limit = 1000
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 1000
    if hasattr(torch._dynamo.config, "accumulated_recompile_limit"):
        torch._dynamo.config.accumulated_recompile_limit = 10000
    props = torch.cuda.get_device_properties(device)
    print(
        json.dumps(
            {
                "gpu": props.name,
                "torch": torch.__version__,
                "shared_memory_per_block_optin": getattr(
                    props, "shared_memory_per_block_optin", None
                ),
            }
        ),
        flush=True,
    )
    T = args.length
    mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, T, T, device="cuda")
    kernel = torch.compile(flex_attention, dynamic=False)
    for d in args.head_dim:
        for backward in args.passes:
            for kind in args.kinds:
                for level in args.levels:
                    if time.monotonic() - start > args.budget_s:
                        print(json.dumps({"stopped": "budget"}), flush=True)
                        return
                    row = {"kind": kind, "head_dim": d, "backward": backward, "level": level}
                    shape = (args.batch, args.heads, args.length, d)
                    row.update(attempt(kernel, mask, kind, shape, LADDER[level], backward))
                    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

"""The GPU run's targets, read off its figures: what was measured against each, and
whether it held. Reported, never asserted: the targets are what a GPU of the H100
class should reach, and a run on another device (or ``--tiny`` on the CPU) says so.

- bf16 utilisation (MFU) of 40% or more on ``base`` for rope and nope, compiled;
- training tokens/s at 1.2x x-transformers' or better for the bias encodings;
- and never below 1.0x for any encoding;
- evaluation memory at 32x at most 1.2x NoPE's, for every encoding;
- the real-scale study: ALiBi flat (perplexity at the longest length within 1.1x of
  1x), sinusoidal and unscaled RoPE rising (more than 1.5x), and rope + YaRN between
  ALiBi and unscaled RoPE.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from worker.catalog.encodings import REGISTRY

MFU = 0.40
BIAS_RATIO = 1.2
MEMORY_VS_NOPE = 1.2
FLAT, RISING = 1.1, 1.5
NOT_MEASURED = "not measured"


def _held(ok: bool | None) -> str:
    return NOT_MEASURED if ok is None else ("yes" if ok else "no")


def _numbers(pairs: Iterable[tuple[str, object]]) -> dict[str, float]:
    return {key: float(value) for key, value in pairs if isinstance(value, int | float)}


def _shown(values: dict[str, float]) -> str:
    return ", ".join(f"{key} {value:.3g}" for key, value in values.items()) or "-"


def utilisation(train: list[dict[str, Any]]) -> list[str]:
    values = _numbers(
        (row["encoding"], row.get("compiled_utilisation"))
        for row in train
        if row["encoding"] in ("rope", "nope")
    )
    ok = None if len(values) < 2 else min(values.values()) >= MFU
    return [f"bf16 MFU >= {MFU:.0%}, rope and nope compiled", _shown(values), _held(ok)]


def ratios(train: list[dict[str, Any]], families: set[str] | None) -> dict[str, float]:
    """Each encoding's lowest ratio to x-transformers over the modes measured."""
    lowest: dict[str, float] = {}
    for row in train:
        if families is not None and REGISTRY[row["encoding"]].family not in families:
            continue
        found = _numbers((key, value) for key, value in row.items() if key.endswith("_ratio"))
        if found:
            lowest[row["encoding"]] = min(found.values())
    return lowest


def speed(train: list[dict[str, Any]]) -> list[list[str]]:
    bias, every = ratios(train, {"bias"}), ratios(train, None)
    return [
        [
            f"training tokens/s >= {BIAS_RATIO}x x-transformers', bias encodings",
            _shown(bias),
            _held(min(bias.values()) >= BIAS_RATIO if bias else None),
        ],
        [
            "training tokens/s >= 1.0x x-transformers', every encoding",
            f"lowest {_shown(dict([min(every.items(), key=lambda kv: kv[1])]))}" if every else "-",
            _held(min(every.values()) >= 1.0 if every else None),
        ],
    ]


def memory(evaluation: list[dict[str, Any]]) -> list[str]:
    values = _numbers(
        (row["encoding"], row.get("memory_vs_nope")) for row in evaluation if row["factor"] == 32
    )
    ok = max(values.values()) <= MEMORY_VS_NOPE if values else None
    return [f"evaluation memory at 32x <= {MEMORY_VS_NOPE}x NoPE's", _shown(values), _held(ok)]


def growth(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Perplexity at the longest length over perplexity at the first, per line of the
    study (``rope`` unscaled, ``rope+yarn:auto``)."""
    out = {}
    for row in rows:
        lengths = sorted((key for key in row if key.isdigit()), key=int)
        first, last = row.get(lengths[0]), row.get(lengths[-1])
        if isinstance(first, float) and isinstance(last, float) and first > 0:
            variant = "" if row["variant"] == "none" else f"+{row['variant']}"
            out[f"{row['encoding']}{variant}"] = last / first
    return out


def ordering(rows: list[dict[str, Any]]) -> list[str]:
    rise = growth(rows)
    alibi, sinusoidal, rope = rise.get("alibi"), rise.get("sinusoidal"), rise.get("rope")
    yarn = next((value for key, value in rise.items() if key.startswith("rope+yarn")), None)
    if None in (alibi, sinusoidal, rope, yarn):
        ok = None
    else:
        ok = alibi <= FLAT and min(sinusoidal, rope) > RISING and alibi <= yarn <= rope
    return [
        f"study: ALiBi flat (<= {FLAT}x), sinusoidal and rope rising (> {RISING}x), "
        "rope + yarn between",
        "longest / 1x: " + _shown(rise),
        _held(ok),
    ]


def targets(parts: list[dict[str, Any]]) -> list[list[str]]:
    """Rows (target, measured, held) for a report's parts."""
    figures = {part["part"]: part.get("figures") or {} for part in parts}

    def rows_of(name: str) -> list[dict[str, Any]]:
        return figures.get(name, {}).get("rows") or []

    train = rows_of("train")
    return [
        utilisation(train),
        *speed(train),
        memory(rows_of("eval")),
        ordering(rows_of("study")),
    ]

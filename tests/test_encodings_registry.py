"""The registry is the single source the CLI, spec validation and dashboard read."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import dims

from worker.encodings import REGISTRY, SCALINGS, EncodingConfigError, build
from worker.encodings.base import PositionEncoding

EXPECTED = {
    "nope",
    "sinusoidal",
    "learned",
    "rope",
    "xpos",
    "alibi",
    "t5",
    "kerple_log",
    "kerple_power",
    "fire",
    "randomized",
}


def test_registry_lists_every_encoding_with_reference_and_summary() -> None:
    assert set(REGISTRY) == EXPECTED
    assert set(SCALINGS) == {"pi", "ntk", "dynamic_ntk", "yarn"}
    for entry in REGISTRY.values():
        assert entry.reference and entry.summary
        assert entry.family in {"none", "absolute", "rotary", "bias"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_build_returns_the_registered_protocol(name: str) -> None:
    encoding = build(name, **dims())
    assert isinstance(encoding, PositionEncoding)
    assert encoding.name == name
    assert encoding.has_bias == (REGISTRY[name].family == "bias")
    assert (encoding.bias(4, 4) is not None) == encoding.has_bias
    assert hasattr(encoding, "with_scaling") == REGISTRY[name].scalable
    expected_limit = 32 if REGISTRY[name].bounded_by_train_length else None
    if name != "randomized":
        assert encoding.max_length == expected_limit


def test_unknown_encoding_names_the_available_ones() -> None:
    with pytest.raises(EncodingConfigError, match=r"unknown encoding 'rotary'.*rope"):
        build("rotary", **dims())


def test_unknown_parameter_names_the_allowed_ones() -> None:
    with pytest.raises(EncodingConfigError, match=r"no parameter 'theta' \(allowed: base"):
        build("rope", theta=500000, **dims())


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("rope", {"rotary_fraction": 0.3}, r"one of 0.25, 0.5, 1.0, got 0.3"),
        ("rope", {"base": 1.0}, r"'base' must be float >= 2, got 1.0"),
        ("rope", {"base": "big"}, r"'base' must be a number"),
        ("t5", {"num_buckets": 2}, r"'num_buckets' must be int in \[4, 1024\], got 2"),
        ("t5", {"num_buckets": 3.5}, r"must be an integer"),
        ("randomized", {"base_encoding": "alibi"}, r"one of 'sinusoidal', 'rope'"),
        ("fire", {"init_c": float("nan")}, r"must be finite"),
    ],
)
def test_out_of_range_parameters_say_what_is_allowed(
    name: str, params: dict[str, object], message: str
) -> None:
    with pytest.raises(EncodingConfigError, match=message):
        build(name, **params, **dims())


def test_odd_dimensions_are_rejected_where_pairs_are_needed() -> None:
    with pytest.raises(EncodingConfigError, match="even d_model"):
        build("sinusoidal", n_heads=1, head_dim=7, d_model=7, train_length=8)


def test_registry_import_does_not_import_torch() -> None:
    code = "import sys, worker.encodings, jobs.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cli_lists_encodings_as_json() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "jobs.cli", "encodings", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    payload = json.loads(out.stdout)
    names = [entry["name"] for entry in payload["encodings"]]
    assert set(names) == EXPECTED
    rope = next(e for e in payload["encodings"] if e["name"] == "rope")
    fraction = next(p for p in rope["params"] if p["name"] == "rotary_fraction")
    assert fraction["choices"] == [0.25, 0.5, 1.0] and fraction["default"] == 1.0
    assert [s["name"] for s in payload["scalings"]] == ["pi", "ntk", "dynamic_ntk", "yarn"]


def test_cli_help_lists_commands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "jobs.cli", "--help"], capture_output=True, text=True, check=True
    )
    assert "encodings" in out.stdout

"""The registry is the single source the CLI, spec validation and dashboard read."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import dims

from cli.render.catalog import catalog_markdown
from core.catalog.encodings import EncodingInfo, Param
from core.spec import parse_spec
from worker.encodings import REGISTRY, SCALINGS, EncodingConfigError, build
from worker.encodings.base import PositionEncoding
from worker.model import build_model

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
    assert set(REGISTRY) >= EXPECTED  # every shipped encoding stays; new ones may join
    assert set(SCALINGS) == {
        "pi",
        "linear",
        "ntk",
        "dynamic_ntk",
        "dynamic",
        "yarn",
        "longrope",
        "llama3",
    }
    for scaling in SCALINGS.values():
        assert scaling.reference and scaling.summary
        assert scaling.same_as is None or scaling.same_as in SCALINGS


def check_entry(name: str) -> None:
    """What every catalogue entry must meet, whatever its family: a reference and a
    summary; ``build`` gives the protocol its entry describes (bias, scalings, length
    limit); a tiny model with it runs at the training length and, unless its table ends
    there, at 4x; a study spec with it (and every scaling, when scalable) validates."""
    entry = REGISTRY[name]
    assert entry.reference and entry.summary
    assert entry.family in {"none", "absolute", "rotary", "bias", "contextual"}
    encoding = build(name, **dims())
    assert isinstance(encoding, PositionEncoding)
    assert encoding.name == name
    assert encoding.has_bias == (entry.family == "bias")
    assert (encoding.bias(4, 4) is not None) == encoding.has_bias
    assert hasattr(encoding, "with_scaling") == entry.scalable
    if entry.bounded_by_train_length:
        assert encoding.max_length == 32
    model = build_model("tiny", name, train_length=16, seed=0).eval()
    lengths = [16] if entry.bounded_by_train_length else [16, 64]
    for length in lengths:
        with torch.no_grad():
            logits = model(torch.randint(0, 256, (1, length)))
        assert logits.shape == (1, length, 256) and torch.isfinite(logits).all()
    variants = ["none", *(f"{s}:2" if SCALINGS[s].needs_factor else s for s in SCALINGS)]
    spec = parse_spec(
        {
            "encodings": [name],
            # tiny's sizes, with the layers a recipe's default pattern needs (6)
            "model": {"d_model": 64, "n_layers": 6, "n_heads": 4},
            "train": {"length": 64, "steps": 2},
            "eval": {"lengths": [64, 128], "variants": variants if entry.scalable else ["none"]},
        }
    )
    assert [e.name for e in spec.encodings] == [name]


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_entry_meets_the_registry_contract(name: str) -> None:
    check_entry(name)


def test_a_new_rotary_entry_is_picked_up_without_further_edits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Adding an encoding = its module (tests/toy_encoding.py here), its catalogue entry
    # and its reference test: the registry contract and the docs table need nothing more.
    rope = REGISTRY["rope"]
    entry = EncodingInfo(
        name="half_speed_rope",
        family="rotary",
        summary="RoPE at half the angular speed.",
        reference="a test entry",
        implementation="toy_encoding:HalfSpeedRope",
        params=(rope.param("base"), rope.param("rotary_fraction")),
        scalable=True,
    )
    assert isinstance(entry.params[0], Param)
    monkeypatch.setitem(REGISTRY, entry.name, entry)
    check_entry(entry.name)
    assert "| half_speed_rope | rotary | base=10000.0, rotary_fraction=1.0 |" in catalog_markdown()
    scalable = "apply to rope, xpos, ssmax, fope, local_global, irope, half_speed_rope"
    assert scalable in catalog_markdown()
    with pytest.raises(Exception, match="fewer than 2 dimensions"):
        parse_spec(
            {
                "encodings": [{"name": "half_speed_rope", "rotary_fraction": 0.25}],
                "model": {"d_model": 16, "n_layers": 1, "n_heads": 4},
            }
        )


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


def test_registry_import_does_not_import_torch_or_transformers() -> None:
    code = (
        "import sys, worker.encodings, core.catalog.scalings, cli; "
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"


def test_cli_lists_encodings_as_json() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cli", "encodings", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    payload = json.loads(out.stdout)
    names = [entry["name"] for entry in payload["encodings"]]
    assert set(names) == set(REGISTRY)
    rope = next(e for e in payload["encodings"] if e["name"] == "rope")
    fraction = next(p for p in rope["params"] if p["name"] == "rotary_fraction")
    assert fraction["choices"] == [0.25, 0.5, 1.0] and fraction["default"] == 1.0
    assert [s["name"] for s in payload["scalings"]] == list(SCALINGS)
    yarn = next(s for s in payload["scalings"] if s["name"] == "yarn")
    assert yarn["aliases"] == {"alpha": "beta_slow", "beta": "beta_fast"}
    longrope = next(s for s in payload["scalings"] if s["name"] == "longrope")
    short = next(p for p in longrope["params"] if p["name"] == "short_factor")
    assert (short["type"], short["min"], short["max"]) == ("list", 1.0, 1024.0)


def test_cli_help_lists_commands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cli", "--help"], capture_output=True, text=True, check=True
    )
    assert "encodings" in out.stdout

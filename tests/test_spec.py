"""Study specs: every bounded field is rejected with its field, value and allowed range."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from core.spec import PRESET_SPECS, SpecError, load_spec, parse_spec, preset_spec

BASE: dict[str, Any] = {"encodings": ["rope"], "model": "tiny", "train": {"length": 32}}


def with_value(path: str, value: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
    spec = copy.deepcopy(base or BASE)
    *parents, leaf = path.split(".")
    node = spec
    for key in parents:
        if isinstance(node.get(key), str):
            node[key] = {}
        node = node.setdefault(key, {})
    node[leaf] = value
    return spec


def rejected(spec: dict[str, Any]) -> str:
    with pytest.raises(SpecError) as caught:
        parse_spec(spec)
    return str(caught.value)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("model.d_model", 8, "model.d_model = 8: must be greater than or equal to 16"),
        ("model.d_model", 8192, "model.d_model = 8192: must be less than or equal to 4096"),
        ("model.n_layers", 0, "model.n_layers = 0: must be greater than or equal to 1"),
        ("model.n_layers", 65, "model.n_layers = 65: must be less than or equal to 64"),
        ("model.n_heads", 128, "model.n_heads = 128: must be less than or equal to 64"),
        ("train.length", 4, "train.length = 4: must be greater than or equal to 8"),
        ("train.length", 20_000, "train.length = 20000: must be less than or equal to 16384"),
        ("train.steps", 0, "train.steps = 0: must be greater than or equal to 1"),
        ("train.steps", 300_000, "train.steps = 300000: must be less than or equal to 200000"),
        ("train.batch_size", 2048, "train.batch_size = 2048: must be less than or equal to 1024"),
        ("train.lr", 0, "train.lr = 0: must be greater than 0"),
        ("train.lr", 2.0, "train.lr = 2.0: must be less than or equal to 1"),
        ("train.min_lr_ratio", 1.5, "train.min_lr_ratio = 1.5: must be less than or equal to 1"),
        ("train.warmup", 0.9, "train.warmup = 0.9: must be less than or equal to 0.5"),
        ("train.weight_decay", -1, "train.weight_decay = -1: must be greater than or equal to 0"),
        ("train.grad_clip", 0, "train.grad_clip = 0: must be greater than 0"),
        ("train.checkpoint_every", 0, "train.checkpoint_every = 0: must be greater than or equal"),
        ("train.progress_every", 0, "train.progress_every = 0: must be greater than or equal"),
        ("eval.lengths", [1], "eval.lengths[0] = 1: must be greater than or equal to 2"),
        (
            "eval.lengths",
            [200_000],
            "eval.lengths[0] = 200000: must be less than or equal to 131072",
        ),
        ("eval.lengths", [], "eval.lengths: must have at least 1 item"),
        ("eval.lengths", list(range(8, 80, 2)), "eval.lengths: must have at most 32 items"),
        (
            "eval.protocols",
            ["strided"],
            "eval.protocols[0] = 'strided': Input should be 'nonoverlapping', 'sliding', "
            "'document' or 'decode'",
        ),
        ("eval.stride", 0, "eval.stride = 0: must be greater than or equal to 1"),
        ("eval.tokens", 10, "eval.tokens = 10: must be greater than or equal to 64"),
        (
            "eval.tokens",
            1 << 30,
            "eval.tokens = 1073741824: must be less than or equal to 16777216",
        ),
        ("eval.examples", 0, "eval.examples = 0: must be greater than or equal to 1"),
        ("eval.batch_tokens", 1, "eval.batch_tokens = 1: must be greater than or equal to 256"),
        ("eval.variants", ["pi:2"] * 17, "eval.variants: must have at most 16 items"),
        ("seeds", [-1], "seeds[0] = -1: must be greater than or equal to 0"),
        ("seeds", list(range(17)), "seeds: must have at most 16 items"),
        ("encodings", [], "encodings: must have at least 1 item"),
        ("name", "", "name = '': String should have at least 1 character"),
    ],
)
def test_every_bound_names_field_value_and_range(path: str, value: Any, message: str) -> None:
    assert message in rejected(with_value(path, value))


def test_cross_field_limits() -> None:
    many = ["nope", "sinusoidal", "rope", "alibi", "t5"]
    assert "5 x 16 = 80 runs; at most 64" in rejected(
        {**BASE, "encodings": many, "seeds": list(range(16))}
    )
    assert "exceed the limit of 1,000,000,000" in rejected(
        with_value("model", {"d_model": 4096, "n_layers": 64, "n_heads": 32})
    )
    huge = with_value("train", {"length": 16384, "steps": 200_000, "batch_size": 1024})
    assert "tokens per run; at most 68,719,476,736" in rejected(huge)
    assert "d_model=100 must be divisible by n_heads=3" in rejected(
        with_value("model", {"d_model": 100, "n_heads": 3})
    )
    assert "head_dim = d_model / n_heads = 5 must be even" in rejected(
        with_value("model", {"d_model": 20, "n_heads": 4})
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({**BASE, "trian": {}}, "trian: unknown key (allowed: name, task, model, train"),
        (
            with_value("train.stepz", 3),
            "train.stepz: unknown key (allowed: length, min_length, steps",
        ),
        ({**BASE, "encodings": ["ropee"]}, "unknown encoding 'ropee' (available: nope"),
        ({**BASE, "encodings": [{"name": "rope", "base": 1}]}, "'base' must be float >= 2, got 1"),
        ({**BASE, "encodings": ["rope", "rope"]}, "listed twice: ['rope']"),
        ({**BASE, "seeds": [1, 1]}, "each seed may appear once"),
        ({**BASE, "model": "huge"}, "unknown model preset 'huge' (allowed: tiny, small"),
        ({**BASE, "task": "sorting"}, "unknown task 'sorting' (available: lm, passkey"),
        (
            {**BASE, "task": {"name": "lm", "corpora": "x"}},
            "no parameter 'corpora' (allowed: corpus)",
        ),
        (
            {**BASE, "task": "passkey"},
            "task 'passkey' needs sequences of at least 128 bytes; train.length is 32",
        ),
        (with_value("eval.protocols", ["sliding"]), "eval.stride is required"),
        (
            with_value("eval", {"protocols": ["sliding"], "stride": 64, "lengths": [32, 64]}),
            "eval.stride = 64 exceeds the shortest evaluation length 32",
        ),
        (
            {**BASE, "encodings": ["alibi"], "eval": {"variants": ["yarn:4"]}},
            "'yarn:4' scales RoPE and applies to rope, xpos, ssmax, fope, local_global, irope; "
            "this study trains none of them",
        ),
        (with_value("eval.variants", ["pi:0.5"]), "factor must be in [1, 1024] or 'auto', got 0.5"),
        (with_value("eval.variants", ["pi:big"]), "factor must be a number >= 1 or 'auto'"),
        (with_value("eval.variants", ["dynamic_ntk:2"]), "variant 'dynamic_ntk' takes no factor"),
        (
            {**BASE, "encodings": ["randomized"], "eval": {"lengths": [32, 4096]}},
            "randomized: max_position = 2048 must be at least the training length 32 and the "
            "longest evaluation length 4096",
        ),
        (
            {**BASE, "task": "copy", "eval": {"protocols": ["sliding"], "stride": 8}},
            "'sliding' applies to language modelling, not 'copy'",
        ),
        # A null parameter is the default: the same configuration as the bare name.
        ({**BASE, "encodings": ["rope", {"name": "rope", "base": None}]}, "listed twice: ['rope']"),
        (
            {**BASE, "encodings": [{"name": "rope", "base": 2e4}, {"name": "rope", "base": 20000}]},
            "listed twice: ['rope(base=20000)']",
        ),
        ({**BASE, "encodings": ["yarn"]}, "RoPE scalings are evaluation variants: eval.variants"),
        ({**BASE, "task": {"name": "copy", "alphabet": None}}, "'alphabet' must be int in"),
        ({**BASE, "task": {"name": "lm", "corpus": "bogus"}}, "corpus 'bogus' is not one of"),
        ({**BASE, "task": {"name": "lm", "corpus": ""}}, "corpus '' is not one of"),
        ({**BASE, "task": {"name": "lm", "corpus": "text:"}}, "corpus 'text:' is not one of"),
        ({**BASE, "task": {"name": "lm", "corpus": "hf::x"}}, "corpus 'hf::x' names no dataset"),
        (
            {
                **BASE,
                "encodings": [{"name": "randomized", "max_position": 32}],
                "eval": {"lengths": [32]},
                "train": {"length": 64},
            },
            "max_position = 32 must be at least the training length 64",
        ),
        (
            {
                **BASE,
                "model": {"d_model": 32, "n_heads": 16},
                "eval": {"variants": ["none", "ntk:4"]},
            },
            "'ntk:4' with rope: raises the base to the power r/(r-2) and needs a rotary "
            "width r >= 4; it rotates 2",
        ),
        (
            {
                **BASE,
                "model": {"d_model": 16, "n_heads": 4},
                "encodings": [{"name": "rope", "rotary_fraction": 0.25}],
            },
            "rotary_fraction=0.25 of head_dim=4 leaves fewer than 2 dimensions to rotate",
        ),
        (
            {**BASE, "encodings": [{"name": "fire", "init_c": 1e300}]},
            "'init_c' must be float in [0.0001, 100]",
        ),
        (
            {**BASE, "encodings": [{"name": "xpos", "scale_base": 1e9}]},
            "'scale_base' must be float in [1, 1e+06]",
        ),
        (
            {**BASE, "encodings": [{"name": "t5", "num_buckets": 1024, "max_distance": 8}]},
            "max_distance=8 must exceed num_buckets / 2 = 512",
        ),
        ({**BASE, "model": {"preset": "bogus"}}, "unknown model preset 'bogus'"),
        (
            {**BASE, "model": {"preset": "tiny", "d_model": 128}},
            "preset 'tiny' has d_model=64; give either a preset or dimensions, not both",
        ),
        (
            with_value("train.length", "128"),
            "train.length = '128': Input should be a valid integer",
        ),
        (
            with_value("train.compile", "yes"),
            "train.compile = 'yes': Input should be a valid boolean",
        ),
        ({**BASE, "seeds": [True]}, "seeds[0] = True: Input should be a valid integer"),
        (
            with_value("eval.variants", [{"method": "pi", "factor": True}]),
            "eval.variants[0].factor",
        ),
        (with_value("eval.stride", 8), "eval.stride applies to the 'sliding' protocol only"),
        (with_value("eval.variants", ["none", "none"]), "listed twice: none"),
        (with_value("eval.variants", ["pi:4", "pi:4.0"]), "listed twice: pi:4"),
        (
            {**BASE, "task": {"name": "assoc_recall", "key_length": 1}, "eval": {"lengths": [256]}},
            "key_length=1 has 26 distinct keys; length 256 needs 50",
        ),
        (
            with_value(
                "eval.variants",
                [
                    {
                        "method": "yarn",
                        "factor": 1.23456789,
                        "alpha": 0.123456789,
                        "beta": 31.1234,
                        "temperature": False,
                        "finetune": {
                            "steps": 199_999,
                            "length": 16384,
                            "lr": 0.000123456789,
                            "batch_size": 1000,
                            "weight_decay": 0.123456,
                            "warmup_steps": 12345,
                        },
                    }
                ],
            ),
            "is longer than 120 characters",
        ),
        ({**BASE, "name": "  "}, "name: must not be blank"),
        ({**BASE, "name": "a\nb"}, "name: must be printable text"),
        ({**BASE, "name": "a\x00b"}, "name: must be printable text"),
    ],
)
def test_cross_field_and_registry_errors(spec: dict[str, Any], message: str) -> None:
    assert message in rejected(spec)


def test_not_a_mapping() -> None:
    with pytest.raises(SpecError, match="a spec is a mapping"):
        parse_spec(["rope"])


def test_presets_are_valid_and_bounded() -> None:
    for name in PRESET_SPECS:
        spec = preset_spec(name)
        assert spec.name == name
    quick = preset_spec("quick")
    assert [e.name for e in quick.encodings] == [
        "nope",
        "sinusoidal",
        "learned",
        "rope",
        "alibi",
        "t5",
    ]
    assert quick.train.length == 128 and quick.eval.lengths == [128, 256, 512, 1024, 2048, 4096]
    with pytest.raises(SpecError, match="unknown preset 'fast'"):
        preset_spec("fast")


def test_config_hash_is_stable_and_covers_what_changes_results() -> None:
    spec = parse_spec({**BASE, "encodings": ["rope", "alibi"], "seeds": [0, 1]})
    hashes = [run.config_hash for run in spec.runs()]
    assert len(set(hashes)) == 4
    assert hashes == [run.config_hash for run in parse_spec(spec.model_dump()).runs()]
    # Neither the study's name nor the other runs change a run's hash...
    renamed = parse_spec({**BASE, "name": "other", "encodings": ["rope"], "seeds": [0]})
    assert renamed.runs()[0].config_hash == hashes[0]
    # ...an explicit default does not either; a real change does.
    explicit = parse_spec({**BASE, "encodings": [{"name": "rope", "base": 10000.0}]})
    assert explicit.runs()[0].config_hash == hashes[0]
    changed = parse_spec({**BASE, "encodings": [{"name": "rope", "base": 500000}]})
    assert changed.runs()[0].config_hash != hashes[0]
    longer = parse_spec(with_value("train.steps", 601, {**BASE, "encodings": ["rope"]}))
    assert longer.runs()[0].config_hash != hashes[0]


def test_labels_and_variants() -> None:
    spec = parse_spec(
        {
            **BASE,
            "encodings": ["rope", {"name": "rope", "base": 500000}],
            "eval": {"variants": ["none", "pi", "yarn:4", "dynamic_ntk"]},
        }
    )
    assert [e.label for e in spec.encodings] == ["rope", "rope(base=500000)"]
    assert [v.label for v in spec.eval.variants] == ["none", "pi:auto", "yarn:4", "dynamic_ntk"]
    pi = spec.eval.variants[1]
    assert pi.factor_at(128, 32) == 4.0 and pi.factor_at(16, 32) == 1.0
    assert spec.eval.variants[2].factor_at(128, 32) == 4.0


def test_load_yaml_and_json(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text("encodings: [rope, alibi]\nmodel: tiny\n")
    assert [e.name for e in load_spec(tmp_path / "s.yaml").encodings] == ["rope", "alibi"]
    (tmp_path / "s.json").write_text('{"encodings": ["nope"]}')
    assert load_spec(tmp_path / "s.json").encodings[0].name == "nope"
    (tmp_path / "bad.yaml").write_text("encodings: [rope\n")
    with pytest.raises(SpecError, match="is not valid YAML"):
        load_spec(tmp_path / "bad.yaml")
    with pytest.raises(SpecError, match="cannot read spec file"):
        load_spec(tmp_path / "missing.yaml")


def test_yaml_round_trip() -> None:
    import yaml

    spec = preset_spec("quick")
    assert parse_spec(yaml.safe_load(spec.to_yaml())) == spec


def test_a_model_preset_may_be_given_as_a_mapping() -> None:
    spec = parse_spec({**BASE, "model": {"preset": "large"}})
    assert (spec.model.d_model, spec.model.n_layers, spec.model.n_heads) == (768, 12, 12)
    # What to_yaml writes (the preset and its dimensions) reads back as itself.
    again = parse_spec({**BASE, "model": spec.model.model_dump()})
    assert again.model == spec.model


def test_the_trained_model_is_always_the_first_variant() -> None:
    # 'none' is evaluated whether listed or not: both forms are one study, one hash.
    listed = parse_spec(with_value("eval.variants", ["none", "yarn:4"]))
    implied = parse_spec(with_value("eval.variants", ["yarn:4"]))
    assert [v.label for v in implied.eval.variants] == ["none", "yarn:4"]
    assert [r.config_hash for r in listed.runs()] == [r.config_hash for r in implied.runs()]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        (
            "twice.yaml",
            b"encodings: [rope]\ntrain: {steps: 10}\ntrain: {steps: 20}\n",
            "line 3: key 'train' is given twice",
        ),
        ("twice.json", b'{"encodings": ["rope"], "seeds": [0], "seeds": [1]}', "'seeds' is given"),
        ("latin1.yaml", b"encodings: [rope]\nname: \xff\xfe\n", "is not UTF-8 text (byte 24)"),
        ("empty.yaml", b"\n  \n", "is empty; a spec needs at least 'encodings'"),
        (
            "bomb.yaml",
            b"a: &a [x, x, x, x, x, x, x, x, x, x]\n"
            b"b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
            b"c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\n"
            b"d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
            b"e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\nencodings: [rope]\n",
            "expands to more than 100,000 values",
        ),
        ("listkey.yaml", b"? [a, b]\n: 1\nencodings: [rope]\n", "line 1: a key must be a name"),
        ("mapkey.yaml", b"{a: 1}: 2\nencodings: [rope]\n", "not a dict"),
        ("deep.yaml", b"encodings: " + b"[" * 5000 + b"]" * 5000, "nests deeper than a spec"),
        ("deep.json", b'{"encodings": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests deeper"),
        ("deep2.yaml", b"encodings: " + b"[" * 40 + b"]" * 40, "nests deeper than a spec can"),
        # Refused on the text, before converting: Python's int() refuses over 4,300
        # digits only after reading them, and a megabyte of base-60 costs half a minute.
        ("long.yaml", b"encodings: [rope]\nseeds: [" + b"9" * 5000 + b"]", "at most 40"),
        ("long.json", b'{"seeds": [' + b"9" * 5000 + b"]}", "at most 40"),
        ("hex.yaml", b"encodings: [rope]\nseeds: [0x" + b"f" * 4000 + b"]", "at most 40"),
        ("base60.yaml", b"encodings: [rope]\nseeds: [" + b"1:" * 400_000 + b"1]", "at most 40"),
        ("float.json", b'{"seeds": [1.' + b"5" * 5000 + b"]}", "a number of 5,002 characters"),
        ("date.yaml", b"name: 2023-13-45\nencodings: [rope]\n", "is not valid YAML: 'month"),
    ],
)
def test_spec_files_are_read_strictly(
    tmp_path: Path, name: str, content: bytes, message: str
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    assert message in str(caught.value)


def test_yaml_reads_exponent_numbers_as_numbers(tmp_path: Path) -> None:
    # YAML 1.1 reads 1e4 as the string '1e4'; people mean ten thousand.
    path = tmp_path / "spec.yaml"
    path.write_text("encodings: [{name: rope, base: 1e4}, {name: rope, base: 5E+5}]\n")
    spec = load_spec(path)
    assert [e.resolved_params["base"] for e in spec.encodings] == [1e4, 5e5]


def test_errors_never_echo_a_huge_value() -> None:
    message = rejected({**BASE, "encodings": [{"name": "rope", "base": "x" * 200_000}]})
    assert len(message) < 300 and "(200,002 characters)" in message


def test_yarn_parameters_may_be_set_per_variant() -> None:
    spec = parse_spec(
        with_value("eval.variants", ["none", {"method": "yarn", "factor": 8, "beta": 16}])
    )
    (yarn,) = [v for v in spec.eval.variants if v.method == "yarn"]
    assert yarn.params == {"beta": 16.0} and yarn.label == "yarn:8(beta=16)"
    by_parts = parse_spec(
        with_value("eval.variants", [{"method": "yarn", "factor": "auto", "temperature": False}])
    ).eval.variants[-1]
    assert by_parts.label == "yarn:auto(temperature=false)"
    for variant, message in [
        ({"method": "yarn", "gamma": 1}, "variant 'yarn' has no parameter 'gamma'"),
        ({"method": "pi", "beta": 2}, "variant 'pi' has no parameter 'beta' (allowed: none)"),
        (
            {"method": "yarn", "alpha": 8, "beta": 4},
            "variant 'yarn' needs beta_fast > beta_slow (beta > alpha in the older names)",
        ),
    ]:
        assert message in rejected(with_value("eval.variants", [variant]))


def test_config_hashes_change_only_with_what_a_run_measures() -> None:
    # Runs are reused across studies by config hash. A field added to the spec must not
    # change the hash of a spec that leaves it at its default; a change of what a run
    # measures bumps RESULTS_VERSION instead. Values of RESULTS_VERSION 3 (2026-11-30).
    assert [r.config_hash for r in preset_spec("smoke").runs()][:2] == [
        "4b2dfc4562327f94caa799c6",
        "4727d83b04e4da30378b0d25",
    ]
    # The paper preset evaluates ntk:16 instead of ntk:auto (dynamic_ntk's twin) since 2026-11-30.
    assert preset_spec("paper").runs()[0].config_hash == "47ad439160659fbc537821b0"
    custom = parse_spec(
        {
            "encodings": [{"name": "rope", "base": 20000}],
            "eval": {"variants": ["none", "yarn:4"]},
            "model": "tiny",
            "train": {"length": 32},
        }
    )
    assert custom.runs()[0].config_hash == "5943b26d723893af344d3e0e"
    accumulated = parse_spec({**BASE, "train": {"length": 32, "grad_accum": 2}})
    assert accumulated.runs()[0].config_hash != parse_spec(BASE).runs()[0].config_hash
    # AdamW, the default, named or not: the same run; Muon trains another model.
    plain = parse_spec(BASE).runs()[0]
    named = parse_spec({**BASE, "train": {"length": 32, "optimizer": "adamw"}}).runs()[0]
    assert named.config_hash == plain.config_hash and named.train_hash == plain.train_hash
    muon = parse_spec({**BASE, "train": {"length": 32, "optimizer": "muon"}}).runs()[0]
    assert muon.train_hash != plain.train_hash


def test_evaluation_lengths_default_to_multiples_of_the_training_length() -> None:
    spec = parse_spec({**BASE, "train": {"length": 48}})
    assert spec.eval.lengths == [48, 96, 192, 384]
    given = parse_spec({**BASE, "train": {"length": 48}, "eval": {"lengths": [100]}})
    assert given.eval.lengths == [100]  # a list given is kept as it is
    assert (
        parse_spec({**BASE, "train": {"length": 48}, "eval": {"tokens": 128}}).eval.lengths[0] == 48
    )
    # The stored spec names them, so the study reads the same whatever the defaults become.
    assert "- 384" in spec.to_yaml()


@pytest.mark.parametrize("train", [None, "fast", [1, 2], 3])
def test_a_train_section_that_is_not_a_mapping_is_a_message_not_a_crash(train) -> None:
    with pytest.raises(SpecError, match="train"):
        parse_spec({**BASE, "train": train})


def test_training_lengths_may_be_drawn_per_step() -> None:
    spec = parse_spec(with_value("train", {"length": 64, "min_length": 16}))
    assert spec.train.tokens_per_step == 16 * 40  # the mean length, for estimates
    fixed = parse_spec(with_value("train", {"length": 64}))
    assert spec.runs()[0].train_hash != fixed.runs()[0].train_hash  # another model
    message = rejected(with_value("train", {"length": 64, "min_length": 128}))
    assert "train: min_length = 128 exceeds length = 64" in message
    assert "train.min_length = 1: must be greater than or equal to 2" in rejected(
        with_value("train", {"length": 64, "min_length": 1})
    )
    passkey = {**with_value("train", {"length": 128, "min_length": 16}), "task": "passkey"}
    assert "task 'passkey' needs sequences of at least 128 bytes; train.min_length is 16" in (
        rejected(passkey)
    )


def test_fine_tuned_variants_parse_label_and_derive_their_training() -> None:
    spec = parse_spec(
        with_value(
            "eval.variants",
            [
                "yarn:4+ft200",
                "pi:2+ft50@96",
                {"method": "ntk", "factor": 4, "finetune": {"steps": 10, "lr": 1e-3}},
                {"method": "yarn", "factor": 8, "beta": 16, "finetune": 30},
            ],
        )
    )
    labels = [v.label for v in spec.eval.variants]
    assert labels == [
        "none",
        "yarn:4+ft200",
        "pi:2+ft50@96",
        "ntk:4+ft10(lr=0.001)",
        "yarn:8(beta=16)+ft30",
    ]
    yarn = spec.finetune_spec(spec.eval.variants[1])
    # factor x the training length, a tenth of the peak rate held after the warmup,
    # the study's batch and schedule otherwise, no validation.
    # The training's tokens per step by default: 16 x 32 = 4 x 128.
    assert (yarn.steps, yarn.length, yarn.batch_size) == (200, 128, 4)
    assert yarn.lr == pytest.approx(spec.train.lr / 10) and yarn.min_lr_ratio == 1.0
    # The papers' recipe: 20 warmup steps, no weight decay (wd / warmup may be given).
    assert yarn.warmup == 20 / 200 and yarn.weight_decay == 0.0 and yarn.val_every == 0
    custom = parse_spec(
        with_value(
            "eval.variants",
            [{"method": "pi", "factor": 4, "finetune": {"steps": 8, "weight_decay": 0.1}}],
        )
    )
    (_, pi) = custom.eval.variants
    assert pi.label == "pi:4+ft8(wd=0.1)"
    assert custom.finetune_spec(pi).warmup == 0.5 and custom.finetune_spec(pi).weight_decay == 0.1
    assert spec.finetune_spec(spec.eval.variants[2]).length == 96
    assert spec.finetune_spec(spec.eval.variants[3]).lr == 1e-3
    # Fine-tuning tokens over the runs it applies to: one rotary encoding, one seed.
    assert spec.finetune_tokens() == 200 * 512 + 50 * 5 * 96 + 10 * 512 + 30 * 512
    # Without a scaling: fine-tuned at the given length, for every encoding.
    direct = parse_spec(
        {**with_value("eval.variants", ["none+ft20@64"]), "encodings": ["rope", "alibi"]}
    )
    assert [v.label for v in direct.eval.variants] == ["none", "none+ft20@64"]
    assert direct.finetune_spec(direct.eval.variants[1]).length == 64
    assert direct.finetune_tokens() == 2 * 20 * 8 * 64
    # The variant is part of what a run measures: its config hash, not its train hash.
    plain = parse_spec(with_value("eval.variants", ["yarn:4"]))
    tuned = parse_spec(with_value("eval.variants", ["yarn:4", "yarn:4+ft200"]))
    assert plain.runs()[0].config_hash != tuned.runs()[0].config_hash
    assert plain.runs()[0].train_hash == tuned.runs()[0].train_hash


@pytest.mark.parametrize(
    ("variants", "message"),
    [
        (["yarn+ft10"], "variant 'yarn' with finetune needs a number factor"),
        (["yarn:auto+ft10"], "variant 'yarn' with finetune needs a number factor"),
        (["dynamic_ntk+ft10"], "fine-tuning applies to a scaling with one fixed factor (pi"),
        ([{"method": "none", "finetune": 5}], "variant 'none' with finetune (fine-tuning at a"),
        (["none+ft10"], "needs finetune.length, e.g. 'none+ft200@512'"),
        (
            ["yarn:4+fx10"],
            "after '+' comes the fine-tuning (ftSTEPS or ftSTEPS@LENGTH) or log-n scaling (logn)",
        ),
        (["yarn:4+ft"], "after '+' comes the fine-tuning"),
        (["yarn:4+ft10@x"], "after '+' comes the fine-tuning"),
        (["yarn:4+ft10@"], "after '+' comes the fine-tuning"),
        (["yarn:4+ft0"], "finetune.steps = 0: must be greater than or equal to 1"),
        (
            [{"method": "pi", "factor": 2, "finetune": {"steps": 5, "length": 4}}],
            "finetune.length = 4: must be greater than or equal to 8",
        ),
        (
            [{"method": "pi", "factor": 2, "finetune": {"steps": 5, "warmup": 0}}],
            "finetune.warmup: unknown key (allowed: steps, length, lr, batch_size, "
            "weight_decay, warmup_steps)",
        ),
        (["pi:2+ft5@16"], "fine-tunes at 16 tokens, shorter than train.length = 32"),
        (["yarn:1024+ft10"], "fine-tunes at 32768 tokens; at most 16384"),
        (["yarn:4+ft200", "yarn:4.0+ft200"], "listed twice: yarn:4+ft200"),
    ],
)
def test_fine_tuned_variants_are_refused_with_a_reason(variants: list, message: str) -> None:
    assert message in rejected(with_value("eval.variants", variants))


def test_the_papers_fine_tuning_settings_fit_in_a_label() -> None:
    paper = {
        "method": "yarn",
        "factor": 4,
        "temperature": False,
        "finetune": {"steps": 400, "length": 128, "lr": 2e-5},
    }
    (_, yarn) = parse_spec(with_value("eval.variants", [paper])).eval.variants
    assert yarn.label == "yarn:4(temperature=false)+ft400@128(lr=2e-05)"


def test_fine_tuning_is_bounded_in_total_and_by_the_task() -> None:
    # Each variant alone fits; together they read more than one run may.
    big = {"steps": 100_000, "length": 16384, "batch_size": 40}
    variants = [{"method": "pi", "factor": f, "finetune": big} for f in (2, 3, 4)]
    assert "training and fine-tuning read" in rejected(with_value("eval.variants", variants))
    # A fine-tuning shorter than the task's examples is refused before anything trains.
    passkey = {**with_value("eval.variants", ["none+ft2@16"]), "task": "passkey"}
    passkey["train"] = {"length": 128}
    assert "task 'passkey' needs sequences of at least" in rejected(passkey)


def test_messages_never_echo_a_huge_input() -> None:
    huge = "z" * 500_000
    spec = {
        "encodings": [{"name": "rope", huge: 1}, huge],
        huge: 1,
        "eval": {"variants": [f"yarn:{huge}"]},
    }
    with pytest.raises(SpecError) as caught:
        parse_spec(spec)
    message = str(caught.value)
    assert len(message) < 2000 and "(500,002 characters)" in message
    assert "allowed: base, proportional, rotary_fraction, window" in message  # still said


def test_labels_keep_every_digit_so_two_settings_never_share_one() -> None:
    spec = parse_spec(
        with_value(
            "eval.variants",
            [
                "pi:4",
                "pi:1.0000001",
                {"method": "yarn", "factor": 2, "beta": 16},
                {"method": "yarn", "factor": 2, "beta": 16.0000001},
                "yarn:4+ft20",
            ],
        )
    )
    assert [v.label for v in spec.eval.variants] == [
        "none",
        "pi:4",
        "pi:1.0000001",
        "yarn:2(beta=16)",
        "yarn:2(beta=16.0000001)",
        "yarn:4+ft20",
    ]


@pytest.mark.parametrize("variant", ["pi:4+ft\u00b2", "pi:4+ft\u0663", "pi:4+ft3@\u0663"])
def test_fine_tuning_steps_are_ascii_digits(variant: str) -> None:
    with pytest.raises(SpecError, match="after '\\+' comes the fine-tuning"):
        parse_spec(with_value("eval.variants", [variant]))


@pytest.mark.parametrize("factor", [True, [4], {"x": 1}])
def test_a_factor_that_is_not_a_number_says_what_is_allowed(factor) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(with_value("eval.variants", [{"method": "pi", "factor": factor}]))
    assert "factor must be a number >= 1 or 'auto'" in str(caught.value)
    assert "literal" not in str(caught.value)


def test_evaluation_work_is_bounded_per_run() -> None:
    heavy = {
        "encodings": ["rope"],
        "eval": {
            "protocols": ["sliding", "nonoverlapping"],
            "stride": 1,
            "tokens": 1 << 24,
            "lengths": [65_536, 131_072],
        },
    }
    with pytest.raises(SpecError, match="a longer stride"):
        parse_spec(heavy)
    heavy["eval"]["stride"] = 4096
    assert parse_spec(heavy).eval_tokens() == (1 << 24) * (16 + 32 + 2)


def test_notes_say_what_runs_as_written_but_is_worth_knowing() -> None:
    spec = parse_spec(
        {
            "encodings": ["rope", "alibi"],
            "train": {"length": 128},
            "eval": {"lengths": [128, 512], "variants": ["ntk:auto", "dynamic_ntk", "yarn:auto"]},
        }
    )
    notes = spec.notes()
    assert len(notes) == 2
    assert "dynamic_ntk and ntk:auto give the same numbers" in notes[0]
    assert "fastest pair turns 20 times, fewer than beta_fast = 32" in notes[1]
    assert "beta_slow = 0.0312, beta_fast = 1" in notes[1]
    # The paper's scale (or a beta fitted to this one), one of the two: nothing to say.
    fitted = {"method": "yarn", "factor": "auto", "alpha": 0.03, "beta": 1}
    spec = parse_spec(
        {
            "encodings": ["rope"],
            "train": {"length": 128},
            "eval": {"lengths": [128, 512], "variants": ["ntk:auto", fitted]},
        }
    )
    assert spec.notes() == []
    assert parse_spec({"encodings": ["alibi"], "eval": {"variants": ["none"]}}).notes() == []
    # The paper preset compares dynamic NTK with NTK fixed for its longest length.
    assert parse_spec(PRESET_SPECS["paper"]).notes() == []


def test_presets_are_the_spec_files_users_can_copy() -> None:
    from core.spec.presets import PRESET_NAMES, PRESETS_DIR

    files = {path.stem for path in PRESETS_DIR.glob("*.yaml")}
    assert files == set(PRESET_NAMES)
    for name in PRESET_NAMES:
        # The same loader and checks as `posbench run <file>`: the same study.
        assert load_spec(PRESETS_DIR / f"{name}.yaml") == preset_spec(name)

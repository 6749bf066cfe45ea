"""posbench export-hf: finished runs trained by the worker runtime, written as HF
transformers folders by the command line, loaded back with AutoModelForCausalLM and
AutoTokenizer and compared with posbench's own forward pass; and the refusals."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from cli import app
from core import settings as settings_module
from core.catalog.corpora import SourcePolicy
from core.settings import Settings
from core.spec import parse_spec
from db.migrate import upgrade
from jobs import lifecycle
from jobs.service import submit
from worker.data.lm import DOC_SEPARATOR, load_corpus
from worker.model import Transformer
from worker.run import build_run_model

TRAIN_LENGTH = 32
SPEC = {
    "name": "hf *export*",  # shown escaped in the model card
    "model": "tiny",
    "train": {"length": TRAIN_LENGTH, "steps": 3, "batch_size": 2},
    "encodings": ["rope", {"name": "rope", "rotary_fraction": 0.25}, "nope", "alibi"],
    "eval": {"lengths": [TRAIN_LENGTH], "tokens": 64, "variants": ["none", "yarn:4"]},
}
# Text as posbench reads it: UTF-8 bytes, NUL between documents, non-ASCII included.
TEXT = (
    "def f(x):\n    return x * 2  # doubled\n\x00Grüße, 東京! Ā and ü are two bytes each. "
    "for i in range(10):\n\tprint(i, 'é')\n"
) * 2


class Trained:
    """A study of four runs (rope, rope with a quarter rotated, nope: trained and
    evaluated by the worker runtime; alibi: never run), and its settings."""

    def __init__(self, settings: Settings, runs: dict[str, int]) -> None:
        self.settings = settings
        self.runs = runs
        self.spec = parse_spec(SPEC)

    def export(self, *args: str) -> Any:
        return CliRunner().invoke(app, ["export-hf", *args])

    def checkpoint(self, label: str) -> Path:
        return self.settings.artifacts_dir / "runs" / f"{self.runs[label]}.pt"

    def posbench_model(self, label: str) -> Transformer:
        """The trained model as posbench evaluates it, from the run's checkpoint."""
        run_spec = next(r for r in self.spec.runs() if r.encoding.label == label)
        model = build_run_model(self.spec, run_spec)
        state = torch.load(self.checkpoint(label), map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        return model.eval()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trained]:
    from worker.runtime import execute

    home = tmp_path_factory.mktemp("export-hf")
    environment = {
        "POSBENCH_HOME": str(home),
        "POSBENCH_DATABASE_URL": f"sqlite:///{home}/posbench.db",
        "POSBENCH_DEVICE": "cpu",
        "POSBENCH_MIN_CHECKPOINT_SECONDS": "0",
    }
    with pytest.MonkeyPatch.context() as patch:
        for name, value in environment.items():
            patch.setenv(name, value)
        settings_module.get_settings.cache_clear()
        settings = settings_module.get_settings()
        upgrade(settings.database)
        queued = submit(
            parse_spec(SPEC), actor="tester", settings=settings, send=lambda run_id: None
        ).queued
        labels = ["rope", "rope(rotary_fraction=0.25)", "nope", "alibi"]
        runs = dict(zip(labels, queued, strict=True))
        for label in labels[:3]:
            claimed = lifecycle.claim(settings.database, runs[label], "node")
            assert execute.execute(claimed, "node") == "done"
        yield Trained(settings, runs)
    settings_module.get_settings.cache_clear()


def exported(trained: Trained, label: str, out: Path, *args: str):
    """The HF model and tokenizer ``posbench export-hf`` wrote for ``label``'s run."""
    done = trained.export(str(trained.runs[label]), "--out", str(out), *args)
    assert done.exit_code == 0, done.output
    assert f"-> {out}: transformers' logits equal posbench's" in done.stdout
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "GPTNeoXForCausalLM" and model.dtype == torch.float32
    return model.eval(), AutoTokenizer.from_pretrained(out)


def tokens_of(tokenizer, length: int) -> torch.Tensor:
    ids = tokenizer(TEXT)["input_ids"]
    assert ids == list(TEXT.encode("utf-8"))
    assert len(ids) >= length
    return torch.tensor([ids[:length]])


@pytest.mark.parametrize(("label", "rotated"), [("rope", 16), ("rope(rotary_fraction=0.25)", 4)])
def test_a_rope_run_reloads_with_posbench_s_logits(
    trained: Trained, tmp_path: Path, label: str, rotated: int
) -> None:
    hf, tokenizer = exported(trained, label, tmp_path / "hf")
    assert hf.config.use_parallel_residual is False
    assert hf.gpt_neox.layers[0].attention.rotary_ndims == rotated
    assert hf.config.max_position_embeddings == TRAIN_LENGTH
    tokens = tokens_of(tokenizer, 2 * TRAIN_LENGTH)
    with torch.no_grad():
        ours = trained.posbench_model(label)(tokens)
        theirs = hf(tokens).logits
        # Positions are in the model: told the tokens sit twice as far apart, it predicts
        # otherwise (the same shift for all would change nothing: RoPE is relative).
        moved = hf(tokens, position_ids=2 * torch.arange(tokens.shape[1])[None]).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    assert (moved - theirs).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("label", "variant", "params", "stored"),
    [
        ("rope", "yarn:4", {}, True),
        ("rope(rotary_fraction=0.25)", "yarn:4", {}, True),
        ("rope", "{method: yarn, factor: 4, beta_fast: 16}", {"beta_fast": 16.0}, False),
    ],
)
def test_yarn_set_on_both_sides_gives_the_same_logits_at_four_times_the_length(
    trained: Trained, tmp_path: Path, label: str, variant: str, params: dict, stored: bool
) -> None:
    hf, tokenizer = exported(trained, label, tmp_path / "hf", "--variant", variant)
    rope = hf.config.rope_parameters
    beta_fast = params.get("beta_fast", 32.0)
    assert (rope["rope_type"], rope["factor"], rope["beta_fast"]) == ("yarn", 4.0, beta_fast)
    assert rope["original_max_position_embeddings"] == TRAIN_LENGTH
    tokens = tokens_of(tokenizer, 4 * TRAIN_LENGTH)
    model = trained.posbench_model(label)
    with torch.no_grad():
        plain = model(tokens)
        with model.scaled("yarn", 4.0, TRAIN_LENGTH, **params) as scaled:
            ours = scaled(tokens)
        theirs = hf(tokens).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    assert (plain - ours).abs().max() > 1e-3  # the scaling is in force on both sides
    card = (tmp_path / "hf" / "README.md").read_text()
    shown = "yarn:4" if not params else "yarn:4(beta_fast=16)"
    assert f"| scaling in the config | {shown} |" in card
    # The points posbench stored for the variant, or a line saying there are none.
    assert (f"| nonoverlapping | {TRAIN_LENGTH} |" in card) == stored


def test_a_nope_run_reloads_without_position_information(trained: Trained, tmp_path: Path) -> None:
    hf, tokenizer = exported(trained, "nope", tmp_path / "hf")
    assert hf.config.rope_parameters["partial_rotary_factor"] == 0.0
    assert hf.gpt_neox.layers[0].attention.rotary_ndims == 0
    tokens = tokens_of(tokenizer, 3 * TRAIN_LENGTH)
    with torch.no_grad():
        ours = trained.posbench_model("nope")(tokens)
        theirs = hf(tokens).logits
        moved = hf(tokens, position_ids=7 * torch.arange(tokens.shape[1])[None] + 1000).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    assert torch.equal(moved, theirs)


def test_the_folder_holds_a_byte_tokenizer_with_posbench_s_ids_and_a_model_card(
    trained: Trained, tmp_path: Path
) -> None:
    _, tokenizer = exported(trained, "nope", tmp_path / "hf")
    # posbench's data pipeline on the same text: a text: corpus of one document, split
    # by position into training and validation bytes.
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "doc.txt").write_text(TEXT, encoding="utf-8")
    policy = SourcePolicy(roots=((tmp_path / "corpus").resolve(),))
    corpus = load_corpus(f"text:{tmp_path / 'corpus' / 'doc.txt'}", tmp_path / "cache", policy)
    read = [*corpus.train.tolist(), *corpus.valid.tolist()]
    assert tokenizer(TEXT)["input_ids"] == read
    assert tokenizer.decode(read) == TEXT
    separator = DOC_SEPARATOR[0]
    assert tokenizer.eos_token_id == tokenizer.bos_token_id == tokenizer.pad_token_id == separator
    assert len(tokenizer) == 256
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["GPTNeoXForCausalLM"]
    assert (config["rotary_pct"], config["eos_token_id"]) == (0.0, separator)
    card = (tmp_path / "hf" / "README.md").read_text()
    run_id = trained.runs["nope"]
    assert f"# posbench run {run_id}: nope, seed 0" in card
    assert f"length {TRAIN_LENGTH}, 3 steps of 2 |" in card
    assert f"| run | {run_id} of study 1, hf \\*export\\* |" in card
    assert "commit unknown" not in card  # the run's provenance names the code


def test_refusals_exit_2_with_the_reason(trained: Trained, tmp_path: Path) -> None:
    out = tmp_path / "hf"

    def refused(*args: str) -> str:
        done = trained.export(*args)
        assert done.exit_code == 2, done.output
        assert not out.exists() or out.is_symlink() or any(out.iterdir())
        return done.stderr

    alibi = str(trained.runs["alibi"])
    assert "export-hf writes runs of nope, rope" in refused(alibi, "--out", str(out))
    assert "no run 999" in refused("999", "--out", str(out))
    queued = submit(
        parse_spec({**SPEC, "name": "later", "seeds": [1]}),
        actor="tester",
        settings=trained.settings,
        send=lambda run_id: None,
    ).queued[0]
    assert f"run {queued} is queued; only a finished (done) run" in refused(
        str(queued), "--out", str(out)
    )
    rope, nope = str(trained.runs["rope"]), str(trained.runs["nope"])
    assert "one factor" in refused(rope, "--out", str(out), "--variant", "yarn:auto")
    assert "not the run's checkpoint" in refused(rope, "--out", str(out), "--variant", "yarn:4+ft2")
    assert "rotary encodings, not 'nope'" in refused(
        nope, "--out", str(out), "--with-scaling", "pi:2"
    )
    assert "--variant 'nonsense'" in refused(rope, "--out", str(out), "--variant", "nonsense")
    checkpoint = trained.checkpoint("rope")
    os.replace(checkpoint, checkpoint.with_name("aside"))
    try:
        assert "checkpoint is not on this machine" in refused(rope, "--out", str(out))
    finally:
        os.replace(checkpoint.with_name("aside"), checkpoint)
    assert not out.exists()


def test_out_is_written_only_where_nothing_would_be_lost(trained: Trained, tmp_path: Path) -> None:
    rope = str(trained.runs["rope"])
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    done = trained.export(rope, "--out", str(out))
    assert done.exit_code == 2 and "is not empty (notes.txt)" in done.stderr
    done = trained.export(rope, "--out", str(out), "--force")
    assert (
        done.exit_code == 2 and "holds 'notes.txt', which an export does not write" in done.stderr
    )
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    link = tmp_path / "link"
    link.symlink_to(out)
    done = trained.export(rope, "--out", str(link), "--force")
    assert done.exit_code == 2 and "is a symbolic link" in done.stderr
    # An earlier export is replaced with --force, and only with it.
    again = tmp_path / "again"
    assert trained.export(str(trained.runs["nope"]), "--out", str(again)).exit_code == 0
    assert trained.export(rope, "--out", str(again)).exit_code == 2
    done = trained.export(rope, "--out", str(again), "--force")
    assert done.exit_code == 0, done.output
    assert json.loads((again / "config.json").read_text())["rotary_pct"] == 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "hf", "link"]  # no leftovers

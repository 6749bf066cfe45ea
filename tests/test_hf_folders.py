"""Audit F3 and F4, and the slow tokenizer: an hf: model folder is checked whole before
anything is loaded - its weights index names plain files of the folder only, every file
is a regular one, its config's size is within the operator's cap, its weights hold every
block the config describes, and its tokenizer is a fast one - and each refusal is one
line: at submit (the spec's check), from `posbench run` (exit 2), and when the weights
turn out to lack or add tensors at load."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import isolated_env, posbench_cli
from hf_models import CONTEXT, corpus_text, save_model

from core.catalog.hf_configs import HF_FAMILIES, config_parameters
from core.catalog.hf_models import (
    WEIGHTS_FILE,
    WEIGHTS_INDEX,
    HfModelError,
    ModelPolicy,
    local_facts,
)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("home")
    save_model(folder / "models" / "llama", "llama")
    (folder / "corpora").mkdir()
    (folder / "corpora" / "tiny.txt").write_text(corpus_text(60))
    (folder / "decoy.safetensors").write_bytes(
        (folder / "models" / "llama" / WEIGHTS_FILE).read_bytes()
    )
    return folder


def variant(home: Path, name: str) -> Path:
    """A copy of the tiny llama to spoil."""
    folder = home / "models" / name
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(home / "models" / "llama", folder)
    return folder


def sharded(folder: Path, shard: str) -> None:
    """The weights as one shard named by an index: ``shard`` as the index writes it."""
    (folder / WEIGHTS_FILE).rename(folder / "model-00001-of-00001.safetensors")
    names = json.loads(_header(folder / "model-00001-of-00001.safetensors"))
    weight_map = {name: shard for name in names if name != "__metadata__"}
    (folder / WEIGHTS_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _header(path: Path) -> bytes:
    with path.open("rb") as handle:
        return handle.read(int.from_bytes(handle.read(8), "little"))


def edit_config(folder: Path, **values) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **values}))


def slow_tokenizer(home: Path) -> str:
    folder = variant(home, "slow")
    (folder / "tokenizer.json").unlink()
    return "slow"


def outside_shard(home: Path) -> str:
    sharded(variant(home, "outside"), "../../decoy.safetensors")
    return "outside"


def absolute_shard(home: Path) -> str:
    sharded(variant(home, "absolute"), str(home / "decoy.safetensors"))
    return "absolute"


def fifo_shard(home: Path) -> str:
    folder = variant(home, "fifo")
    sharded(folder, "pipe.safetensors")
    os.mkfifo(folder / "pipe.safetensors")  # no writer: reading it would hang
    return "fifo"


def huge_config(home: Path) -> str:
    edit_config(variant(home, "huge"), num_hidden_layers=1_000_000)
    return "huge"


def more_blocks(home: Path) -> str:
    edit_config(variant(home, "deeper"), num_hidden_layers=3)
    return "deeper"


CASES = {
    "slow tokenizer": (slow_tokenizer, "its tokenizer is not a fast one (no tokenizer.json)"),
    "outside shard": (outside_shard, "names '../../decoy.safetensors', not a .safetensors file"),
    "absolute shard": (absolute_shard, "decoy.safetensors', not a .safetensors file of the folder"),
    "fifo shard": (fifo_shard, "pipe.safetensors is not a regular file"),
    "huge config": (huge_config, "parameters, more than this service evaluates (8,000,000,000"),
    "more blocks": (more_blocks, "its config describes 3 blocks, its weights hold 2"),
}


def env(home: Path) -> dict[str, str]:
    return isolated_env(
        home,
        POSBENCH_MODELS_ROOTS=str(home / "models"),
        POSBENCH_CORPUS_ROOTS=str(home / "corpora"),
        POSBENCH_DEVICE="cpu",
        COLUMNS="400",
    )


def spec_file(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.json"
    spec = {
        "name": name,
        "model": {"hf": name},
        "task": {"name": "lm", "corpus": "text:tiny.txt"},
        "train": {"length": CONTEXT},
        "eval": {"lengths": [16, 32], "tokens": 64, "order_probe": False},
    }
    path.write_text(json.dumps(spec))
    return path


@pytest.mark.parametrize("case", CASES)
def test_a_spoiled_folder_is_refused_at_submit_and_by_posbench_run(
    home: Path, tmp_path: Path, case: str
) -> None:
    make, message = CASES[case]
    name = make(home)
    with pytest.raises(HfModelError) as caught:
        local_facts(name, ModelPolicy(roots=((home / "models").resolve(),)))
    assert message in str(caught.value)
    environment = env(home)
    assert posbench_cli("db", "upgrade", env=environment).returncode == 0
    for command in (["submit"], ["run", "--out", str(tmp_path / "out")]):
        done = posbench_cli(
            *command[:1], str(spec_file(tmp_path, name)), *command[1:], env=environment
        )
        assert done.returncode == 2, (command, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


def test_weights_the_architecture_lacks_are_refused_before_and_at_load(
    home: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    from core.catalog.hf_models import weights_problem
    from worker.hf.loader import _check_weights

    folder = variant(home, "lacking")
    tensors = load_file(folder / WEIGHTS_FILE)
    dropped = "model.norm.weight"  # the last norm: every block still there
    save_file({k: v for k, v in tensors.items() if k != dropped}, folder / WEIGHTS_FILE)
    message = f"model.hf 'lacking' lacks weights its config needs: {dropped}"
    environment = env(home)
    assert posbench_cli("db", "upgrade", env=environment).returncode == 0
    for command in (["submit"], ["run", "--out", str(tmp_path / "out")]):
        done = posbench_cli(
            *command[:1], str(spec_file(tmp_path, "lacking")), *command[1:], env=environment
        )
        assert done.returncode == 2, done.stderr
        assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1
    # The folders that are whole (the tiny Llama, its sharded copy) lack nothing.
    policy = ModelPolicy(roots=((home / "models").resolve(),))
    assert weights_problem("llama", policy) is None
    # And at load, what transformers reports is refused the same way.
    with pytest.raises(HfModelError, match=r"lacks weights its config needs: model\.norm\.weight"):
        _check_weights("lacking", {"missing_keys": [dropped]})
    with pytest.raises(HfModelError, match=r"has no place for: extra\.weight"):
        _check_weights("lacking", {"unexpected_keys": ["extra.weight"]})


def test_whole_folders_of_every_family_lack_no_weight(tmp_path: Path) -> None:
    from hf_models import FAMILIES, MORE_ROPE

    from core.catalog.hf_models import weights_problem

    for family in (*FAMILIES, *MORE_ROPE):  # GPT-NeoX stores lm_head as embed_out
        save_model(tmp_path / family, family)
        assert weights_problem(family, ModelPolicy(roots=(tmp_path.resolve(),))) is None, family


def test_a_sharded_folder_loads_and_records_the_files_it_loaded(home: Path) -> None:
    from worker.hf.loader import load_model

    folder = variant(home, "sharded")
    sharded(folder, "model-00001-of-00001.safetensors")
    loaded = load_model("sharded", ModelPolicy(roots=((home / "models").resolve(),)))
    assert loaded.provenance["weights_files"] == ["model-00001-of-00001.safetensors"]


def test_the_parameters_a_config_describes() -> None:
    # Llama 2 7B's sizes: 6.74e9 parameters (its matrices; norms are 0.001% more).
    llama = {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "intermediate_size": 11008,
        "vocab_size": 32000,
    }
    parameters, layers, width = config_parameters(llama, HF_FAMILIES["llama"])
    assert (layers, width) == (32, 4096) and abs(parameters - 6_738_415_616) / 6.74e9 < 0.001
    # GPT-2 small: 124M, with its tied embeddings and 1,024 learned positions.
    gpt2 = {"n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
    parameters, _, _ = config_parameters(gpt2, HF_FAMILIES["gpt2"])
    assert abs(parameters - 124_439_808) / 124.4e6 < 0.001


def test_a_folders_tokenizer_settings_cannot_name_a_file_outside_it(
    home: Path, tmp_path: Path
) -> None:
    """Audit G1: transformers lets a folder's tokenizer_config.json name the tokenizer
    file to read (``fast_tokenizer_files``), an absolute path winning. posbench builds
    the tokenizer from the folder's own tokenizer.json (and reads the special tokens
    itself): a valid tokenizer outside every root is never the one loaded, and the
    provenance hashes the one that is."""
    from tokenizers import Tokenizer, models

    from worker.hf.loader import load_model

    outside = tmp_path / "outside"
    outside.mkdir()
    elsewhere = Tokenizer(models.WordLevel({"<unk>": 0, "owned": 1}, unk_token="<unk>"))
    elsewhere.save(str(outside / "tokenizer.4.0.0.json"))
    folder = variant(home, "pointing-out")
    settings_file = folder / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text())
    settings["fast_tokenizer_files"] = [str(outside / "tokenizer.4.0.0.json")]
    settings["tokenizer_file"] = str(outside / "tokenizer.4.0.0.json")
    settings_file.write_text(json.dumps(settings))
    loaded = load_model("pointing-out", ModelPolicy(roots=((home / "models").resolve(),)))
    own = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert loaded.tokenizer.backend_tokenizer.to_str() == own.to_str()
    assert loaded.tokenizer.backend_tokenizer.to_str() != elsewhere.to_str()
    # The special tokens are the folder's, read as strings.
    assert loaded.tokenizer.eos_token_id == own.token_to_id(settings["eos_token"])
    record = loaded.provenance
    assert len(record["tokenizer_sha256"]) == 64
    assert record["tokenizer_sha256"] != record["config_sha256"]

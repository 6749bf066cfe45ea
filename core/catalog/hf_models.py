"""HuggingFace models as a study's model (``model: {hf: NAME}``): where one may come from
under the operator's rules, and what its ``config.json`` says about how it tells a token
where it sits. Torch-free like the whole catalogue: the spec's check at submit reads the
config as JSON, and the loader on the worker checks the loaded config with the same
rules.

- a local folder (``config.json``, safetensors weights, a tokenizer) inside one of the
  models roots, once resolved (no ``..``, no symbolic link out of the roots, never under
  /proc, /sys or /dev); a relative name is looked up in each root in turn, and a name
  that starts with ``/``, ``~`` or ``.`` is never anything else;
- a hub id (``gpt2``, ``EleutherAI/pythia-70m``) that no models root holds, only where
  an operator turned HuggingFace on (``POSBENCH_HF_DATASETS``, the switch of ``hf:``
  corpora) and within its allow-list (``POSBENCH_HF_ALLOW``) when there is one.

A reason never names a path outside the roots: a refused path reads the same whether or
not it exists.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.catalog.corpora import ALLOW_SETTING, HF_SETTING, HUB_NAME, forbidden, inside
from core.catalog.hf_configs import (
    HfModelError,
    ModelFacts,
    model_facts,
)
from core.files import FileRefused, read_bounded

# A run's encoding when its model is an hf: model: the model's own position encoding.
HF_ENCODING = "hf"
ROOTS_SETTING = "POSBENCH_MODELS_ROOTS"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"  # a fast tokenizer's: posbench reads its offsets
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # sharded weights: which file holds what
MAX_CONFIG_BYTES = 1 << 20
MAX_INDEX_BYTES = 16 << 20
MAX_HEADER_BYTES = 100 << 20  # a safetensors file's JSON header (names, shapes, offsets)
MAX_NAME = 160  # characters of model.hf (a run's label is "hf:" + it, VARCHAR(200))


@dataclass(frozen=True)
class ModelPolicy:
    """The operator's rules on hf: models. The default reads no folder and no hub id:
    only callers that hold the settings widen it."""

    roots: tuple[Path, ...] = ()  # resolved folders
    hub_enabled: bool = False
    hub_allow: tuple[str, ...] = ()  # empty: any hub id, once enabled
    max_parameters: int = 8_000_000_000  # what a config may describe (POSBENCH_MAX_HF_PARAMETERS)

    def roots_shown(self) -> str:
        return ", ".join(map(str, self.roots)) or "none"


NO_MODELS = ModelPolicy()


# -- where a model comes from ---------------------------------------------------------------


@dataclass(frozen=True)
class Located:
    """A model's source: a local folder (resolved, with the root holding it) or a hub id."""

    folder: Path | None = None
    root: Path | None = None
    hub_id: str | None = None

    @property
    def shown(self) -> str:
        return str(self.folder) if self.folder is not None else f"hub:{self.hub_id}"


def explicit_path(name: str) -> bool:
    """Whether ``name`` can only be a folder (never a hub id)."""
    return name.startswith(("/", "~", ".")) or not HUB_NAME.match(name)


def _resolved(path: Path) -> Path | None:
    try:
        return path.resolve()
    except (OSError, RuntimeError):  # a link loop, a name too long
        return None


def _in_roots(name: str, policy: ModelPolicy) -> list[tuple[Path, Path]]:
    """(resolved folder, root) of each place inside the roots that ``name`` names."""
    raw = Path(name).expanduser()
    candidates = [raw] if raw.is_absolute() else [root / raw for root in policy.roots]
    found = []
    for candidate in candidates:
        path = _resolved(candidate)
        if path is None or forbidden(path):
            continue
        root = next((r for r in policy.roots if inside(path, r)), None)
        if root is not None:
            found.append((path, root))
    return found


def locate_model(name: str, policy: ModelPolicy) -> Located:
    """Where ``model.hf`` = ``name`` comes from here; HfModelError (a reason that names no
    path outside the roots) when nowhere allowed."""
    if ".." in Path(name).parts:
        raise HfModelError("model.hf: a path may not contain '..'")
    found = _in_roots(name, policy) if policy.roots else []
    folders = [(path, root) for path, root in found if path.is_dir()]
    if folders:
        return Located(folder=folders[0][0], root=folders[0][1])
    if explicit_path(name):
        if not policy.roots:
            raise HfModelError(
                f"model.hf: local models need a models root ({ROOTS_SETTING}); none is set"
            )
        if found:
            raise HfModelError(f"model.hf {name!r}: no such folder in the models roots")
        raise HfModelError(
            f"model.hf: the path is not inside the models roots ({ROOTS_SETTING}: "
            f"{policy.roots_shown()}); copy the model folder into one of them"
        )
    return Located(hub_id=_hub_id(name, policy))


def _hub_id(name: str, policy: ModelPolicy) -> str:
    where = f"no models root holds a folder {name!r} ({ROOTS_SETTING}: {policy.roots_shown()})"
    if not policy.hub_enabled:
        raise HfModelError(
            f"model.hf: {where}, and HuggingFace hub models are off here; an operator turns "
            f"them on with {HF_SETTING}=true (the switch of hf: corpora), optionally limited "
            f"by {ALLOW_SETTING}"
        )
    if policy.hub_allow and name not in policy.hub_allow:
        raise HfModelError(
            f"model.hf: hub model {name!r} is not in the operator's allow-list "
            f"({ALLOW_SETTING}: {', '.join(policy.hub_allow)})"
        )
    if Path(name).exists():  # from_pretrained would read the worker's own folder
        raise HfModelError(
            f"model.hf: {name!r} is also a local path here; give a local model as a path "
            "inside the models roots, starting with / or ./"
        )
    return name


def folder_problem(folder: Path, root: Path) -> str | None:
    """What keeps a located folder from being read as a model: no config.json, a file
    that links out of the roots (named by its name in the folder, never its target), or
    one that is no regular file (a pipe would hang the load)."""
    if not (folder / CONFIG_FILE).is_file():
        return f"model.hf {folder}: no {CONFIG_FILE} (a HuggingFace model folder has one)"
    for parent, folders, names in os.walk(folder, followlinks=False):
        folders.sort()
        for entry in [*folders, *names]:
            path = Path(parent) / entry
            target = _resolved(path)
            shown = path.relative_to(folder).as_posix()
            if target is None or not inside(target, root) or forbidden(target):
                return f"model.hf {folder}: {shown} links outside the models roots"
            if entry in names and not _regular(path):
                return f"model.hf {folder}: {shown} is not a regular file"
    return None


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return False


def weights_files(folder: Path) -> list[Path]:
    """The safetensors files ``from_pretrained`` reads from ``folder``: model.safetensors,
    else each file its index names, every one a plain file of the folder (audit F3: an
    index naming ``/abs/path`` or ``../x`` was loaded from outside the roots)."""
    single = folder / WEIGHTS_FILE
    if single.exists():
        return [single]
    index = folder / WEIGHTS_INDEX
    if not index.exists():
        raise HfModelError(f"model.hf {folder}: no {WEIGHTS_FILE} and no {WEIGHTS_INDEX}")
    try:
        data = json.loads(read_bounded(index, MAX_INDEX_BYTES, "a weights index"))
    except (FileRefused, OSError, ValueError) as err:
        raise HfModelError(f"model.hf {folder}: {WEIGHTS_INDEX} cannot be read ({err})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise HfModelError(f"model.hf {folder}: {WEIGHTS_INDEX} has no weight_map")
    files = []
    for shard in sorted({str(value) for value in weight_map.values()}):
        plain = shard == Path(shard).name and shard not in ("", ".", "..")
        if not plain or not shard.endswith(".safetensors"):
            raise HfModelError(
                f"model.hf {folder}: {WEIGHTS_INDEX} names {shard[:80]!r}, not a .safetensors "
                "file of the folder"
            )
        if not _regular(folder / shard):
            raise HfModelError(f"model.hf {folder}: {shard} (of {WEIGHTS_INDEX}) is missing")
        files.append(folder / shard)
    return files


_LAYER = re.compile(r"\.(?:layers|h)\.(\d+)\.")


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's name and shape in a safetensors file, from its JSON header alone
    (read within MAX_HEADER_BYTES; no weight is read)."""
    with path.open("rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        if not 0 < size <= MAX_HEADER_BYTES:
            raise HfModelError(f"model.hf {path.parent}: {path.name} is not safetensors")
        try:
            header = json.loads(handle.read(size))
        except ValueError:
            raise HfModelError(f"model.hf {path.parent}: {path.name} is not safetensors") from None
    return {
        name: tuple(entry.get("shape", ()))
        for name, entry in (header.items() if isinstance(header, dict) else ())
        if isinstance(entry, dict) and name != "__metadata__"
    }


def weight_layers(files: list[Path]) -> int:
    """How many transformer blocks the weights hold (1 + the highest block index their
    tensor names carry), read from the safetensors headers alone."""
    highest = -1
    for path in files:
        for name in tensor_shapes(path):
            found = _LAYER.search(f".{name}")
            if found:
                highest = max(highest, int(found[1]))
    return highest + 1


def checked_folder(folder: Path, root: Path, policy: ModelPolicy) -> ModelFacts:
    """A local model folder's facts once everything that can be known before loading it
    holds: the folder's files (folder_problem), its config and size within the policy's
    cap (audit F4), and weights that hold every block the config describes (a missing
    block would be initialised at random and evaluated as the named model)."""
    problem = folder_problem(folder, root)
    if problem:
        raise HfModelError(problem)
    try:
        facts = model_facts(read_config(folder))
    except HfModelError as err:
        raise HfModelError(f"model.hf {folder}: {err}") from None
    if not facts.layers:
        raise HfModelError(
            f"model.hf {folder}: its {CONFIG_FILE} lacks its sizes (hidden_size or n_embd, "
            "num_hidden_layers or n_layer, vocab_size, num_attention_heads or n_head)"
        )
    size_problem(facts, policy, folder)
    if not (folder / TOKENIZER_FILE).is_file():
        raise HfModelError(
            f"model.hf {folder}: its tokenizer is not a fast one (no {TOKENIZER_FILE}); "
            "posbench counts the bytes each token covers from a fast tokenizer's offsets"
        )
    held = weight_layers(weights_files(folder))
    if held != facts.layers:
        raise HfModelError(
            f"model.hf {folder}: its config describes {facts.layers} blocks, its weights hold "
            f"{held}; posbench evaluates a model only as its weights are"
        )
    return facts


def size_problem(facts: ModelFacts, policy: ModelPolicy, name: object) -> None:
    """HfModelError when the config describes more parameters than the policy allows."""
    if facts.parameters > policy.max_parameters:
        raise HfModelError(
            f"model.hf {name}: its config describes {facts.parameters:,} parameters, more than "
            f"this service evaluates ({policy.max_parameters:,}, POSBENCH_MAX_HF_PARAMETERS)"
        )


def read_config(folder: Path) -> dict[str, Any]:
    """The folder's config.json, read within a bound."""
    try:
        data = json.loads(read_bounded(folder / CONFIG_FILE, MAX_CONFIG_BYTES, "a model config"))
    except (FileRefused, OSError, ValueError) as err:
        raise HfModelError(f"model.hf {folder}: {CONFIG_FILE} cannot be read ({err})") from None
    if not isinstance(data, dict):
        raise HfModelError(f"model.hf {folder}: {CONFIG_FILE} is not a JSON object")
    return data


def local_facts(name: str, policy: ModelPolicy) -> tuple[Located, ModelFacts | None]:
    """Where ``name`` comes from and, for a local folder, its config's facts (a hub id's
    are known once a worker has it); HfModelError when it may not be read."""
    located = locate_model(name, policy)
    if located.folder is None or located.root is None:
        return located, None
    return located, checked_folder(located.folder, located.root, policy)


# -- the model folders a root holds (the Submit page's list) --------------------------------

MAX_LISTED = 200  # model folders listed, at most
MAX_SCANNED = 10_000  # entries of one root looked at, at most


@dataclass(frozen=True)
class ModelFolder:
    """A folder directly under a models root with a config.json: ``name`` is its name
    there, ``spec_name`` what ``model.hf`` says to mean it (its name, or its path when an
    earlier root holds a folder of that name)."""

    name: str
    spec_name: str
    root: Path
    folder: Path  # resolved


def _entries(root: Path) -> tuple[list[str], bool]:
    """The names in ``root`` (at most MAX_SCANNED, sorted) and whether more were left."""
    names: list[str] = []
    try:
        with os.scandir(root) as entries:
            for entry in entries:
                if len(names) == MAX_SCANNED:
                    return sorted(names), True
                names.append(entry.name)
    except OSError:  # a root that does not exist (yet) or cannot be read
        return [], False
    return sorted(names), False


def _listed(root: Path, name: str, policy: ModelPolicy) -> ModelFolder | None:
    """The model folder ``root``/``name``, or None: a hidden or unprintable name, one
    model.hf cannot hold, a link out of the roots, no config.json (inside the roots)."""
    if name.startswith(".") or len(name) > MAX_NAME or not name.isprintable():
        return None
    folder = _resolved(root / name)
    if folder is None or forbidden(folder) or folder in policy.roots:
        return None
    if not any(inside(folder, r) for r in policy.roots) or not folder.is_dir():
        return None
    config = _resolved(folder / CONFIG_FILE)
    if config is None or not any(inside(config, r) for r in policy.roots):
        return None
    if not config.is_file():
        return None
    try:
        by_name = locate_model(name, policy).folder
    except HfModelError:
        by_name = None
    spec_name = name if by_name == folder else str(root / name)
    return ModelFolder(name, spec_name, root, folder)


def model_folders(policy: ModelPolicy, limit: int = MAX_LISTED) -> tuple[list[ModelFolder], bool]:
    """The model folders directly under each models root (a folder with a config.json;
    never through a link out of the roots), root by root and by name, at most ``limit``
    of them; and whether some were left out. Each is checked in full (its files, its
    config) only once chosen (``local_facts``)."""
    found: list[ModelFolder] = []
    seen: set[Path] = set()
    left_out = False
    for root in policy.roots:
        names, more = _entries(root)
        left_out = left_out or more
        for name in names:
            listed = _listed(root, name, policy)
            if listed is None or listed.folder in seen:
                continue
            if len(found) == limit:
                return found, True
            seen.add(listed.folder)
            found.append(listed)
    return found, left_out


def locate(name: str, policy: ModelPolicy) -> Located:
    """Where ``name`` comes from, checked here (the worker's file system) as at submit:
    ``checked_folder``."""
    located = locate_model(name, policy)
    if located.folder is not None and located.root is not None:
        checked_folder(located.folder, located.root, policy)
    return located


def weights_problem(name: str, policy: ModelPolicy) -> str | None:
    """Before anything is loaded or queued: the weights a local folder's architecture
        needs that its safetensors files lack (audit F4: they would be initialised at random
        and evaluated as the named model). The architecture is built on the meta device (no
        memory, no weights) from config.json. A weight tied to another (the output embedding
        to the input one) counts as present when either is; one stored under another name
        (transformers renames some on load: GPT-NeoX's embed_out is lm_head) counts as present
        when a stored tensor of its shape is left over. None for a hub id (its files are the
        worker's to check) or when nothing lacks. Here, below the queue, because the service
    asks it at submit and the worker again where it loads."""
    import torch  # the engine's libraries, read only here: nothing of them at import
    from transformers import AutoConfig, AutoModelForCausalLM

    located = locate(name, policy)
    if located.folder is None:
        return None
    config = AutoConfig.from_pretrained(located.folder, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    files: dict[str, tuple[int, ...]] = {}  # each stored tensor's name and shape
    for path in weights_files(located.folder):
        files |= tensor_shapes(path)
    prefix = f"{model.base_model_prefix}."  # a base model's checkpoint, as transformers maps it
    present = set(files) | {prefix + key for key in files}
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors |= dict(model.named_buffers(remove_duplicate=False))
    groups: dict[int, list[str]] = {}  # the names of one tensor (tied weights share one)
    for key in model.state_dict():
        groups.setdefault(id(tensors.get(key, key)), []).append(key)
    named = {key for keys in groups.values() for key in keys}
    spare = [
        shape for key, shape in files.items() if key not in named and prefix + key not in named
    ]
    lacking = []
    for keys in sorted(sorted(keys) for keys in groups.values()):
        if any(key in present for key in keys):
            continue
        shape = tuple(tensors[keys[0]].shape) if keys[0] in tensors else None
        if shape in spare:
            spare.remove(shape)  # stored under another name
        else:
            lacking.append(keys[0])
    if not lacking:
        return None
    shown = ", ".join(lacking[:3]) + (f" and {len(lacking) - 3} more" if len(lacking) > 3 else "")
    return f"model.hf {name!r} lacks weights its config needs: {shown}"

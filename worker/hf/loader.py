"""Loading an hf: model and its tokenizer under the operator's rules (``ModelPolicy``, the
caller's argument: the engine reads no settings).

A local folder is located inside the models roots and checked (config.json, no link out
of the roots) where it is read, then loaded from its files alone; a hub id only where
the policy allows it. Never any code of the model's own (``trust_remote_code=False``),
weights from safetensors only, float32 weights (the evaluation runs bf16 autocast on
CUDA, as for posbench's models), attention by PyTorch's SDPA. What was loaded is
recorded: the config's, the weights' and the tokenizer's SHA-256 for a folder, the hub's
commit for a hub id, and transformers' version.

A folder's tokenizer is built from what was checked, never by ``from_pretrained``: that
lets the folder's own tokenizer_config.json name the files to read (``fast_tokenizer_files``,
``tokenizer_file``), where an absolute or ``../`` path wins (the fourth audit's G1: a
worker opened a tokenizer from outside every root, and /proc/self/environ). posbench reads
the folder's tokenizer.json with the tokenizers library and the special tokens from
tokenizer_config.json and special_tokens_map.json itself, as strings only.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.catalog.corpora import SourcePolicy, scrub
from core.catalog.hf_models import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    TOKENIZER_FILE,
    HfModelError,
    Located,
    ModelFacts,
    ModelPolicy,
    locate,
    model_facts,
    size_problem,
    weights_files,
)
from core.files import FileRefused, read_bounded
from worker.hf.model import HfCausalLM

CHUNK = 8 << 20
# The special tokens posbench takes from a folder (by string, and only those the
# vocabulary holds), from these files, the later overriding the earlier, as transformers
# reads them.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
SPECIAL_TOKEN_FILES = ("tokenizer_config.json", "special_tokens_map.json")


@dataclass
class LoadedModel:
    model: HfCausalLM
    tokenizer: Any  # a fast tokenizer (PreTrainedTokenizerFast or transformers 5's backend)
    facts: ModelFacts
    provenance: dict[str, Any]


def _sha256(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as handle:
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def special_tokens(folder: Path, vocabulary: dict[str, int]) -> dict[str, str]:
    """The folder's begin, end, unknown and padding tokens: strings (or a ``content``
    string) its token files name that ``vocabulary`` holds; nothing else of them is read."""
    found: dict[str, str] = {}
    for name in SPECIAL_TOKEN_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            data = json.loads(read_bounded(path, MAX_CONFIG_BYTES, "a tokenizer's settings"))
        except (FileRefused, OSError, ValueError) as err:
            raise HfModelError(f"model.hf {folder}: {name} cannot be read ({err})") from None
        for key in SPECIAL_TOKENS if isinstance(data, dict) else ():
            value = data.get(key)
            token = value.get("content") if isinstance(value, dict) else value
            if isinstance(token, str) and token in vocabulary:
                found[key] = token
    return found


def checked_tokenizer(folder: Path) -> tuple[Any, str]:
    """A local folder's fast tokenizer, built from its tokenizer.json and the special
    tokens ``special_tokens`` reads, and the SHA-256 of what it was built from."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    path = folder / TOKENIZER_FILE
    backend = Tokenizer.from_file(str(path))
    tokens = special_tokens(folder, backend.get_vocab(with_added_tokens=True))
    digest = hashlib.sha256(bytes.fromhex(_sha256([path])))
    digest.update(json.dumps(tokens, sort_keys=True).encode())
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokens), digest.hexdigest()


def _source(located: Located, name: str) -> tuple[str, dict[str, Any]]:
    """What from_pretrained reads, and its identity for the provenance."""
    import transformers

    record: dict[str, Any] = {"hf": name, "transformers_version": transformers.__version__}
    if located.folder is None:
        return located.hub_id or name, record | {"hub_id": located.hub_id}
    weights = weights_files(located.folder)  # what from_pretrained reads, and nothing else
    record |= {
        "folder": str(located.folder),
        "config_sha256": _sha256([located.folder / CONFIG_FILE]),
        "weights_sha256": _sha256(weights),
        "weights_files": [path.name for path in weights],
    }
    return str(located.folder), record


def _check_weights(name: str, loading: dict[str, Any]) -> None:
    """Audit F4: weights the architecture lacks would be initialised at random (and
    evaluated as the named model); weights it has no place for, silently dropped. Either
    refuses the model, naming a few."""
    for kind, what in (
        ("missing_keys", "lacks weights its config needs"),
        ("unexpected_keys", "holds weights its config has no place for"),
        ("mismatched_keys", "holds weights of other shapes than its config's"),
    ):
        keys = sorted(str(key) for key in loading.get(kind) or [])
        if keys:
            shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
            raise HfModelError(f"model.hf {name!r} {what}: {shown}")


def load_model(name: str, policy: ModelPolicy) -> LoadedModel:
    """``model.hf`` = ``name`` loaded on the CPU in float32, in evaluation mode, with its
    fast tokenizer; HfModelError for one that may not or cannot be loaded here."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    # Its progress bars and load report go to stderr: what matters is refused here instead
    # (_check_weights), in one line.
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()

    located = locate(name, policy)
    source, record = _source(located, name)
    hub = located.folder is None
    common = {"trust_remote_code": False, "local_files_only": not hub}
    try:
        if hub:  # a local folder's size was checked from its config.json
            size_problem(
                model_facts(AutoConfig.from_pretrained(source, **common).to_dict()), policy, name
            )
        config = AutoConfig.from_pretrained(source, **common)
        # SDPA has no logit soft-cap: a model that soft-caps (Gemma 2) runs eager attention.
        softcaps = getattr(config, "attn_logit_softcapping", None) is not None
        model, loading = AutoModelForCausalLM.from_pretrained(
            source,
            attn_implementation="eager" if softcaps else "sdpa",
            dtype=torch.float32,
            use_safetensors=True,
            output_loading_info=True,
            **common,
        )
        if hub:
            tokenizer = AutoTokenizer.from_pretrained(source, **common)
        else:  # only what was checked (audit G1)
            tokenizer, record["tokenizer_sha256"] = checked_tokenizer(Path(source))
    except HfModelError:
        raise
    except Exception as err:  # the libraries raise many types; report any of them plainly
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        # A library's words may name its cache or the working folder: paths outside the
        # roots are not shown.
        reason = scrub(first, SourcePolicy(roots=policy.roots))[:300]
        raise HfModelError(f"model.hf {name!r} could not be loaded: {reason}") from None
    _check_weights(name, loading)
    if not getattr(tokenizer, "is_fast", False):
        raise HfModelError(
            f"model.hf {name!r}: its tokenizer is not a fast one (tokenizer.json); posbench "
            "counts the bytes each token covers from a fast tokenizer's offsets"
        )
    facts = model_facts(model.config.to_dict())
    if hub:
        record["commit"] = getattr(model.config, "_commit_hash", None)
    record |= {
        "model_type": facts.model_type,
        "position_encoding": facts.encoding,
        "context": facts.context,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    model.eval()
    return LoadedModel(HfCausalLM(model, facts), tokenizer, facts, record)

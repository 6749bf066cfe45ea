"""Where a corpus may come from: the operator's rules, and a corpus name checked
against them (torch-free, read by the spec's check at submit and by the reader on
the worker).

- ``text:<path>``: a file or folder inside one of the corpus roots, once resolved (no
  ``..``, no symbolic link out of the roots, never under /proc, /sys or /dev); a
  relative path is looked up in each root in turn;
- ``hf:<name>``: only where an operator turned HuggingFace datasets on, limited to an
  allow-list when one is given; a local dataset folder follows the ``text:`` rules.

A reason never names a path outside the roots: a refused path reads the same whether
or not it exists.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

MiB = 1 << 20
# Never read, whatever the roots: the kernel's views of processes, devices and drivers.
FORBIDDEN = (Path("/proc"), Path("/sys"), Path("/dev"))
# A hub dataset: name or owner/name (a relative path looks the same; see is_local).
HUB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
ROOTS_SETTING = "POSBENCH_CORPUS_ROOTS"
HF_SETTING = "POSBENCH_HF_DATASETS"
ALLOW_SETTING = "POSBENCH_HF_ALLOW"
FILE_CAP_SETTING = "POSBENCH_CORPUS_MAX_FILE_BYTES"
TOTAL_CAP_SETTING = "POSBENCH_CORPUS_MAX_TOTAL_BYTES"


@dataclass(frozen=True)
class SourcePolicy:
    """The operator's rules on corpora. The default reads no ``text:`` path and no
    HuggingFace dataset: only callers that hold the settings widen it."""

    roots: tuple[Path, ...] = ()  # resolved folders
    max_file_bytes: int = 256 * MiB
    max_total_bytes: int = 1024 * MiB
    hf_enabled: bool = False
    hf_allow: tuple[str, ...] = ()  # empty: any hub dataset, once enabled
    # The prepared-corpus cache's bound: past it, the reader evicts the least recently
    # used corpora (worker.data.corpus_cache); None: unbounded.
    max_cache_bytes: int | None = None

    def roots_shown(self) -> str:
        return ", ".join(map(str, self.roots)) or "none"


def inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def forbidden(path: Path) -> bool:
    return any(inside(path, folder) for folder in FORBIDDEN)


def contained(path: Path, policy: SourcePolicy) -> Path | None:
    """The root holding the resolved ``path``, or None (also for /proc, /sys, /dev)."""
    if forbidden(path):
        return None
    return next((root for root in policy.roots if inside(path, root)), None)


def _resolved(path: Path) -> Path | None:
    try:
        return path.resolve()
    except (OSError, RuntimeError):  # a link loop, a name too long
        return None


def locate(location: str, policy: SourcePolicy, kind: str = "text") -> tuple[Path, Path] | str:
    """The resolved file or folder ``location`` names and the root holding it, or why it
    is refused (a reason that does not repeat ``location``)."""
    if not policy.roots:
        return f"corpus {kind}: local paths need a corpus root ({ROOTS_SETTING}); none is set"
    raw = Path(location).expanduser()
    if ".." in raw.parts:
        return f"corpus {kind}: a path may not contain '..'"
    candidates = [raw] if raw.is_absolute() else [root / raw for root in policy.roots]
    found = []
    for candidate in candidates:
        path = _resolved(candidate)
        root = contained(path, policy) if path is not None else None
        if root is not None:
            found.append((path, root))
    existing = [pair for pair in found if pair[0].exists()]
    if existing or found:
        return (existing or found)[0]
    return (
        f"corpus {kind}: the path is not inside the corpus roots ({ROOTS_SETTING}: "
        f"{policy.roots_shown()}); copy the corpus into one of them"
    )


def is_local(name: str) -> bool:
    """Whether an ``hf:`` name is a local folder rather than a hub dataset."""
    return name.startswith(("/", "~", ".")) or not HUB_NAME.match(name)


def hf_problem(spec: str, policy: SourcePolicy) -> str | None:
    """Why ``hf:<spec>`` may not be loaded here, or None."""
    name = spec.split(":")[0].strip()
    if not policy.hf_enabled:
        return (
            f"corpus hf: HuggingFace datasets are off here; an operator turns them on with "
            f"{HF_SETTING}=true, optionally limited by {ALLOW_SETTING} (the paper preset "
            "reads hf:wikitext)"
        )
    if is_local(name):
        located = locate(name, policy, kind="hf")
        return located if isinstance(located, str) else None
    if policy.hf_allow and name not in policy.hf_allow:
        return (
            f"corpus hf:{name} is not in the operator's allow-list ({ALLOW_SETTING}: "
            f"{', '.join(policy.hf_allow)})"
        )
    return None


def corpus_access_problem(corpus: str, policy: SourcePolicy) -> str | None:
    """Why this service may not read ``corpus`` (a well-formed name), or None. A path is
    checked where it can be resolved here; the worker checks it again where it reads."""
    kind, _, rest = corpus.partition(":")
    if kind == "text" and rest.strip():
        located = locate(rest, policy)
        return located if isinstance(located, str) else None
    if kind == "hf" and rest.strip():
        return hf_problem(rest, policy)
    return None


def scrub(message: str, policy: SourcePolicy) -> str:
    """``message`` with every absolute path outside the roots replaced by ``<path>``
    (a library's error may name a cache folder or the working directory)."""

    def keep_inside(match: re.Match[str]) -> str:
        path = _resolved(Path(match.group(0)))
        return match.group(0) if path is not None and contained(path, policy) else "<path>"

    return re.sub(r"(?<![\w.:/~-])/[^\s'\"(),;]*", keep_inside, message)

"""The catalogue as people read it: the encodings and scalings tables of
`posbench encodings` and of docs/encodings.md, both built from the registry rows here,
so a new catalogue entry shows up in both without another edit."""

from __future__ import annotations

from worker.catalog.encodings import REGISTRY, SCALINGS, EncodingInfo

ENCODING_COLUMNS = ("name", "family", "parameters", "summary")
SCALING_COLUMNS = ("name", "summary")


def _parameters(entry: EncodingInfo) -> str:
    params = ", ".join(
        f"{p.name}={p.derived if p.default is None else p.default}" for p in entry.params
    )
    return params or "-"


def encoding_rows() -> list[tuple[str, str, str, str]]:
    """One row per registered encoding: name, family, parameters (defaults), summary."""
    return [(e.name, e.family, _parameters(e), e.summary) for e in REGISTRY.values()]


def scaling_rows() -> list[tuple[str, str]]:
    return [(s.name, s.summary) for s in SCALINGS.values()]


def scalable_names() -> str:
    """The encodings the RoPE scalings apply to, for titles: 'rope, xpos'."""
    return ", ".join(name for name, entry in REGISTRY.items() if entry.scalable)


def _markdown(columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    def line(cells: tuple[str, ...]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    return "\n".join([line(columns), line(tuple("---" for _ in columns)), *map(line, rows)])


def catalog_markdown() -> str:
    """Both tables as markdown (the block between the markers of docs/encodings.md)."""
    return (
        _markdown(ENCODING_COLUMNS, encoding_rows())
        + f"\n\nRoPE inference-time scalings (apply to {scalable_names()}):\n\n"
        + _markdown(SCALING_COLUMNS, scaling_rows())
    )

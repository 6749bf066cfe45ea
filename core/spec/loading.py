"""Reading a spec: from a mapping (the dashboard, the API) or from a YAML file (the
CLI), bounded in size, nodes and depth, with every problem described for a person."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ValidationError,
)

from core.catalog.params import EncodingConfigError, short_repr
from core.files import FileRefused, read_bounded
from core.spec.base import (
    SpecError,
)
from core.spec.study import (
    StudySpec,
)


def _allowed_keys(loc: tuple[Any, ...]) -> list[str]:
    """The keys the model at ``loc`` (minus its last element) accepts."""
    model: Any = StudySpec
    for item in loc[:-1]:
        if isinstance(item, int) or model is None:
            continue
        field = model.model_fields.get(item)
        if field is None:
            return []
        annotation = field.annotation
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        model = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None
        )
        if model is None:
            for candidate in candidates:
                inner = getattr(candidate, "__args__", ())
                model = next(
                    (c for c in inner if isinstance(c, type) and issubclass(c, BaseModel)), None
                )
                if model is not None:
                    break
    return list(model.model_fields) if model is not None else []


def _location(loc: tuple[Any, ...]) -> str:
    parts = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif not (isinstance(item, str) and ("function-" in item or item in ("str", "dict"))):
            name = str(item) if len(str(item)) <= 60 else short_repr(str(item), 60)
            parts.append(("." if parts else "") + name)
    return "".join(parts) or "spec"


def describe(error: ValidationError) -> list[str]:
    """One line per problem: the field, the value given, and what is allowed."""
    lines = []
    for problem in error.errors(include_url=False):
        where = _location(problem["loc"])
        kind = problem["type"]
        value = problem.get("input")
        message = problem["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
        if kind == "extra_forbidden":
            allowed = _allowed_keys(problem["loc"])
            hint = f" (allowed: {', '.join(allowed)})" if allowed else ""
            lines.append(f"{where}: unknown key{hint}")
        elif kind == "missing":
            lines.append(f"{where}: required")
        elif kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
            lines.append(
                f"{where} = {short_repr(value)}: {message.lower().replace('input should', 'must')}"
            )
        elif kind in ("too_short", "too_long"):
            lines.append(f"{where}: {message.lower().replace('list should', 'must')}")
        elif kind == "value_error":
            lines.append(f"{where}: {message}" if where != "spec" else message)
        else:
            lines.append(f"{where} = {short_repr(value)}: {message}")
    return lines


def parse_spec(data: Any) -> StudySpec:
    """Validate a spec given as a mapping; raise :class:`SpecError` listing every problem."""
    if not isinstance(data, dict):
        raise SpecError([f"a spec is a mapping of keys to values, got {type(data).__name__}"])
    try:
        return StudySpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(describe(err)) from None
    except EncodingConfigError as err:
        raise SpecError([str(err)]) from None


MAX_SPEC_BYTES = 1 << 20
MAX_SPEC_NODES = 100_000  # values in the parsed spec, counting every use of a YAML alias
MAX_SPEC_DEPTH = 16  # a spec's deepest value (an encoding's parameter) is at level 4


class _SpecLoader(yaml.SafeLoader):
    """YAML 1.1's safe loader, with two changes: a key given twice is an error (not
    last-wins), and 1e4 is a number (YAML 1.1 wants 1.0e+4; JSON, Python and people
    write 1e4)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, list | dict | set):
                mark = key_node.start_mark
                raise SpecError(
                    [f"line {mark.line + 1}: a key must be a name, not a {type(key).__name__}"]
                )
            if key in seen:
                mark = key_node.start_mark
                raise SpecError(
                    [f"line {mark.line + 1}: key {short_repr(key)} is given twice; give it once"]
                )
            seen[key] = True
        return super().construct_mapping(node, deep=deep)


_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)

# The longest number a spec or a parameter may write: every bound of a spec fits in 20
# characters (seeds and ids below 2^63 have 19 digits). Checked on the text, before it is
# converted: Python refuses an int of over 4,300 digits only after reading it, and YAML's
# base-60 integers (1:20:30) cost time in proportion to their length.
MAX_NUMBER_CHARS = 40


def _short_number(value: str) -> str:
    if len(value) > MAX_NUMBER_CHARS:
        raise SpecError(
            [
                f"a number of {len(value):,} characters ({value[:12]}...): numbers in a spec "
                f"have at most {MAX_NUMBER_CHARS}"
            ]
        )
    return value


def _bounded(construct):
    def construct_number(loader: yaml.SafeLoader, node: yaml.ScalarNode):
        _short_number(str(node.value))
        return construct(loader, node)

    return construct_number


for _tag, _construct in (
    ("tag:yaml.org,2002:int", yaml.constructor.SafeConstructor.construct_yaml_int),
    ("tag:yaml.org,2002:float", yaml.constructor.SafeConstructor.construct_yaml_float),
):
    _SpecLoader.add_constructor(_tag, _bounded(_construct))


def read_scalar(text: str) -> Any:
    """One value written as in a spec (``7`` an int, ``1e-3`` a float, ``true`` a bool,
    anything else the text itself), numbers within ``MAX_NUMBER_CHARS``."""
    try:
        value = yaml.load(text, Loader=_SpecLoader)  # a SafeLoader subclass
    except yaml.YAMLError:
        return text
    return value if isinstance(value, bool | int | float | str) else text


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise SpecError([f"key {short_repr(twice[0])} is given twice; give it once"])
    return dict(pairs)


def _count_nodes(data: Any, budget: int = MAX_SPEC_NODES) -> tuple[int, int]:
    """Values in ``data``, stopping past ``budget`` (YAML aliases can nest a tiny file
    into billions of values), and how deep they nest."""
    count, deepest, stack = 0, 0, [(data, 1)]
    while stack and count <= budget:
        item, depth = stack.pop()
        count += 1
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            stack.extend((value, depth + 1) for value in item.values())
        elif isinstance(item, list):
            stack.extend((value, depth + 1) for value in item)
    return count, deepest


def load_spec(path: str | Path) -> StudySpec:
    """Read a YAML or JSON spec file."""
    return parse_spec(read_spec_file(path))


def read_spec_file(path: str | Path) -> Any:
    """The mapping a YAML or JSON spec file holds, read within the spec's bounds (size,
    values, depth) but not yet validated; SpecError for a file that is not one."""
    path = Path(path)
    try:
        raw = read_bounded(path, MAX_SPEC_BYTES, "a spec")
    except FileRefused as err:
        raise SpecError([str(err)]) from None
    except OSError as err:
        raise SpecError([f"cannot read spec file {path}: {err.strerror}"]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SpecError([f"{path} is not UTF-8 text (byte {err.start})"]) from None
    if not text.strip():
        raise SpecError([f"{path} is empty; a spec needs at least 'encodings'"])
    try:
        if path.suffix == ".json":
            data = json.loads(
                text,
                object_pairs_hook=_json_object,
                parse_int=lambda s: int(_short_number(s)),
                parse_float=lambda s: float(_short_number(s)),
            )
        else:
            data = yaml.load(text, Loader=_SpecLoader)  # a SafeLoader subclass
    except RecursionError:
        raise SpecError(
            [f"{path} nests deeper than a spec can ({MAX_SPEC_DEPTH} levels)"]
        ) from None
    except json.JSONDecodeError as err:
        where = f"line {err.lineno}, column {err.colno}"
        raise SpecError([f"{path} is not valid JSON: {where}: {err.msg}"]) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise SpecError([f"{path} is not valid YAML: {where}{problem}"]) from None
    except SpecError:
        raise
    except ValueError as err:
        # YAML reads 2023-13-45 as a date that does not exist, and the like.
        raise SpecError([f"{path} is not valid YAML: {short_repr(str(err))}"]) from None
    count, depth = _count_nodes(data)
    if count > MAX_SPEC_NODES:
        raise SpecError([f"{path} expands to more than {MAX_SPEC_NODES:,} values (YAML aliases?)"])
    if depth > MAX_SPEC_DEPTH:
        raise SpecError([f"{path} nests deeper than a spec can ({MAX_SPEC_DEPTH} levels)"])
    return data

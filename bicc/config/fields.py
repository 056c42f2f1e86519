"""Field helpers shared by the config schemas: closed choices given as ``Literal`` types, and the check that
names the field.

OmegaConf 2.3 cannot type a field as ``Literal``, so a closed choice keeps ``str`` in the schema and carries
its ``Literal`` in the field's metadata: ``mode: str = choice(Literal["partition", "paired"], "partition")``.
``check_schema`` walks a schema and its nested schemas, rejects any value outside its set (naming the field
and the set) and runs each schema's ``check`` of its own ranges.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from omegaconf import MISSING, OmegaConf

Dtype = typing.Literal["float32", "bfloat16", "float16"]
OnBadRow = typing.Literal["error", "skip"]


def need(cond: bool, field_name: str, message: str) -> None:
    """Raise ``ValueError("config field '<field>': <message>")`` unless ``cond``."""
    if not cond:
        raise ValueError(f"config field '{field_name}': {message}")


def at_least(cfg: Any, group: str, names: tuple[str, ...], low: float, meaning: str = "") -> None:
    """Each of ``names`` in ``cfg`` (the group ``group``) is null or >= ``low``."""
    for name in names:
        value = cfg[name]
        need(value is None or value >= low, f"{group}.{name}", f"must be >= {low:g}{meaning}, got {value}")


def _values(options: Any) -> tuple:
    """The values a ``Literal`` type allows; ``Optional[Literal[...]]`` adds None."""
    if options is type(None):
        return (None,)
    if typing.get_origin(options) is typing.Literal:
        return typing.get_args(options)
    return tuple(v for arg in typing.get_args(options) for v in _values(arg))


def choice(options: Any, default: Any = MISSING) -> Any:
    """A dataclass field restricted to the values of the ``Literal`` type ``options``."""
    return dataclasses.field(default=default, metadata={"choices": _values(options)})


def _schema_of(hint: Any) -> type | None:
    """The dataclass inside ``hint`` (``X`` or ``Optional[X]``), else None."""
    for t in (hint, *typing.get_args(hint)):
        if dataclasses.is_dataclass(t):
            return t
    return None


def _shown(value: Any) -> str:
    return "null" if value is None else str(value)


def check_schema(cfg: Any, schema: type, path: str = "") -> None:
    """Check ``cfg`` against ``schema`` and its nested schemas: every closed-choice field holds one of its
    values, then each schema's own ``check(cfg)`` (ranges of its fields) runs, innermost first."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        options, nested = f.metadata.get("choices"), _schema_of(hints[f.name])
        if (options is None and nested is None) or f.name not in cfg or OmegaConf.is_missing(cfg, f.name):
            continue  # other values are read (and their interpolations resolved) only by the checks that need them
        value, name = cfg[f.name], f"{path}{f.name}"
        if options is not None:
            need(value in options, name, f"'{_shown(value)}' unknown; choose from: {', '.join(map(_shown, options))}")
        if nested is not None and value is not None:
            check_schema(value, nested, f"{name}.")
    if hasattr(schema, "check"):
        schema.check(cfg)

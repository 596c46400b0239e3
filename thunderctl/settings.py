"""`--scheduler KEY=VALUE`: a pydantic model's fields set by name on a command line, checked by the
model, and listed for `--help` from the fields' own defaults and descriptions.

The keys are the model's field names, as a profile's YAML section spells them, so a setting is
declared, defaulted and explained once: in the model.
"""

from __future__ import annotations

import difflib
import types
from enum import Enum
from typing import Any, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from rich.markup import escape

Model = TypeVar("Model", bound=BaseModel)

NONE_WORDS = ("none", "null")
BOUNDS = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤"}  # annotated_types' Gt, Ge, Lt, Le, as pydantic keeps them


class SettingError(ValueError):
    """A KEY=VALUE the model refuses; the message names the option, the key, the value and what is allowed."""


def _parts(field: FieldInfo) -> tuple[Any, bool]:
    """The field's type without None, and whether None is allowed."""
    annotation = field.annotation
    if get_origin(annotation) in (Union, types.UnionType):
        args = get_args(annotation)
        others = [arg for arg in args if arg is not type(None)]
        return others[0], len(others) < len(args)
    return annotation, False


def allowed(field: FieldInfo) -> str:
    """What a value of `field` may be, in words: `a number > 0 and ≤ 1.5`, `shortest or longest-in-tool`."""
    kind, optional = _parts(field)
    if isinstance(kind, type) and issubclass(kind, Enum):
        text = " or ".join(str(member.value) for member in kind)
    elif kind is bool:
        text = "true or false"
    else:
        text = "a whole number" if kind is int else "a number"
        bounds = [
            f"{sign} {getattr(item, attribute):g}"
            for item in field.metadata
            for attribute, sign in BOUNDS.items()
            if getattr(item, attribute, None) is not None
        ]
        text = " and ".join([f"{text} {bounds[0]}", *bounds[1:]]) if bounds else text
    return f"{text}, or none" if optional else text


def shown(value: Any) -> str:
    """A value as one would type it after KEY=."""
    if value is None:
        return "none"
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


def parse_settings(model: type[Model], specs: list[str], option: str, base: dict[str, Any] | None = None) -> Model:
    """`model` from `base` with each `KEY=VALUE` of `specs` on top (later ones win); raises SettingError."""
    fields = model.model_fields
    given: dict[str, tuple[str, str]] = {}  # field name -> (the spec as typed, its value)
    for spec in specs:
        key, sep, value = spec.partition("=")
        name = key.strip()
        if not sep or not name:
            first, field = next(iter(fields.items()))
            raise SettingError(f"{option} {spec!r}: give KEY=VALUE, e.g. {option} {first}={shown(field.default)}")
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise SettingError(f"{option} {spec}: no setting {key!r}{hint}; the settings: {', '.join(fields)}")
        given[name] = (spec, value.strip())
    values: dict[str, Any] = dict(base or {})
    for name, (_, value) in given.items():
        optional = _parts(fields[name])[1]
        values[name] = None if optional and value.lower() in NONE_WORDS else value
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise SettingError("; ".join(_explain(error, given, fields, option) for error in exc.errors())) from None


def _explain(error: Any, given: dict[str, tuple[str, str]], fields: dict[str, FieldInfo], option: str) -> str:
    name = str(error["loc"][0]) if error["loc"] else ""
    message = str(error["msg"]).removeprefix("Value error, ")
    if name not in fields:
        return f"{option}: {message}"
    where = f"{option} {given[name][0]}" if name in given else name
    if error["type"] == "enum":  # pydantic's message lists the members already
        return f"{where}: {message}"
    return f"{where}: {message}; allowed: {allowed(fields[name])}"


def settings_help(model: type[BaseModel], option: str) -> str:
    """Every setting of `model`, one per line, for a typer command's epilog (rich markup)."""
    lines = [f"[bold]{option} KEY=VALUE[/] settings, repeatable (KEY = default: allowed values; what it does):"]
    for name, field in model.model_fields.items():
        lines.append(
            f"[bold]{name}[/] = {escape(shown(field.default))}: {escape(allowed(field))}; "
            f"{escape(field.description or '')}"
        )
    return "\n".join(lines)

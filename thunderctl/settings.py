"""`--scheduler KEY=VALUE`: a pydantic model's fields set by name on a command line, checked by the
model, and listed for `--help` from the fields' own defaults and descriptions.

The keys are the model's field names, a section's (a field that is a model) as `section.name`, as a
profile's YAML nests them, so a setting is declared, defaulted and explained once: in the model.
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


def setting_fields(model: type[BaseModel]) -> dict[str, FieldInfo]:
    """Every setting of `model` by its key; a section's (a field that is a model itself) as `section.name`."""
    fields: dict[str, FieldInfo] = {}
    for name, field in model.model_fields.items():
        section = field.annotation
        if isinstance(section, type) and issubclass(section, BaseModel):
            fields |= {f"{name}.{inner}": setting for inner, setting in section.model_fields.items()}
        else:
            fields[name] = field
    return fields


def _suggestion(key: str, keys: list[str]) -> str:
    """The setting `key` was likely meant as, matched on the whole key or on its name within a section."""
    by_name = {candidate.rpartition(".")[2]: candidate for candidate in keys}
    close = difflib.get_close_matches(key, keys, n=1) or [
        by_name[name] for name in difflib.get_close_matches(key.rpartition(".")[2], by_name, n=1)
    ]
    return f" (did you mean {close[0]}?)" if close else ""


def parse_settings(model: type[Model], specs: list[str], option: str, base: dict[str, Any] | None = None) -> Model:
    """`model` from `base` with each `KEY=VALUE` of `specs` on top (later ones win); raises SettingError.

    A model may declare `renamed` (old key -> its key today): an old key is handed to the model
    as given, whose validator reads it (and says it is renamed)."""
    fields = setting_fields(model)
    renamed: dict[str, str] = getattr(model, "renamed", {})
    given: dict[str, tuple[str, str, str]] = {}  # key today -> (the spec as typed, the key as typed, its value)
    for spec in specs:
        key, sep, value = spec.partition("=")
        name = key.strip()
        if not sep or not name:
            first, field = next(iter(fields.items()))
            raise SettingError(f"{option} {spec!r}: give KEY=VALUE, e.g. {option} {first}={shown(field.default)}")
        current = renamed.get(name, name)
        if current not in fields:
            hint = _suggestion(name, list(fields))
            raise SettingError(f"{option} {spec}: no setting {key!r}{hint}; the settings: {', '.join(fields)}")
        given[current] = (spec, name, value.strip())
    values: dict[str, Any] = dict(base or {})
    for current, (_, name, value) in given.items():
        parsed = None if _parts(fields[current])[1] and value.lower() in NONE_WORDS else value
        section, dot, inner = name.partition(".")
        if dot:
            values.setdefault(section, {})[inner] = parsed
        else:
            values[name] = parsed
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise SettingError("; ".join(_explain(error, given, fields, option) for error in exc.errors())) from None


def _explain(error: Any, given: dict[str, tuple[str, str, str]], fields: dict[str, FieldInfo], option: str) -> str:
    name = ".".join(str(part) for part in error["loc"])
    message = str(error["msg"]).removeprefix("Value error, ")
    if name not in fields:
        return f"{option}: {message}"
    where = f"{option} {given[name][0]}" if name in given else name
    if error["type"] == "enum":  # pydantic's message lists the members already
        return f"{where}: {message}"
    return f"{where}: {message}; allowed: {allowed(fields[name])}"


def settings_help(model: type[BaseModel], option: str) -> str:
    """Every setting of `model`, one per line, a section's under its heading, for a typer command's epilog (rich markup)."""
    lines = [f"[bold]{option} KEY=VALUE[/] settings, repeatable (KEY = default: allowed values; what it does):"]
    heading = ""
    for key, field in setting_fields(model).items():
        section, dot, _ = key.rpartition(".")
        if dot and section != heading:
            heading = section
            doc = (model.model_fields[section].annotation.__doc__ or "").strip()  # type: ignore[union-attr]
            lines.append(f"[bold underline]{section}[/]: {escape(doc)}")
        lines.append(
            f"[bold]{key}[/] = {escape(shown(field.default))}: {escape(allowed(field))}; "
            f"{escape(field.description or '')}"
        )
    return "\n".join(lines)

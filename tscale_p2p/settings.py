"""Typed settings: each setting is one field of a pydantic section, declared once with its help and its bounds.

A section is a pydantic dataclass whose fields are made with `option()`. The command line (`tscale_p2p.cli`)
turns its fields into flags, a `--config FILE.toml` table of the same name fills it, and pydantic checks the
values; `one_line()` turns pydantic's report into the project's one line naming the bad value.
"""

from __future__ import annotations

import types
import typing

import pydantic

# Pydantic's lax mode: a TOML file's "3" for an integer is 3, but "many" is refused. Unknown keys are refused.
SECTION_CONFIG = pydantic.ConfigDict(extra="forbid")


def option(default=None, help: str = "", *, metavar: str | None = None, const=None, repeat: bool = False,
           unit: str | None = None, **bounds):
    """A section field: its default, its help text, pydantic bounds (ge=, gt=, le=, lt=), and what the command
    line needs beyond its type: a METAVAR, the `const` a flag given without a value takes, whether a list is
    given by repeating the flag (`repeat`; else as `--flag A B`), and the `unit` an error names ("seconds")."""
    extra = {key: value for key, value in (("metavar", metavar), ("const", const), ("repeat", repeat or None),
                                           ("unit", unit)) if value is not None}
    return pydantic.Field(default, description=help, json_schema_extra=extra or None, **bounds)


def section_fields(cls) -> dict[str, pydantic.fields.FieldInfo]:
    """A section's fields by name, in declaration order (a section's bases first)."""
    return dict(cls.__pydantic_fields__)


def field_extra(info: pydantic.fields.FieldInfo) -> dict:
    return info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}


def value_types(info: pydantic.fields.FieldInfo) -> tuple[object, ...]:
    """The field's annotation with None taken out of an Optional: (int,), (Literal[...],), (tuple[str, ...],)."""
    hint = info.annotation
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(arg for arg in typing.get_args(hint) if arg is not type(None))
    return (hint,)


def one_line(error: pydantic.ValidationError, cls, name_of: typing.Callable[[str], str]) -> str:
    """The first problem pydantic found, as one line naming the setting (`name_of(field)`) and the bad value."""
    problem = error.errors(include_url=False)[0]
    loc = [part for part in problem["loc"] if isinstance(part, str)]
    field = loc[-1] if loc else ""
    name, kind, ctx, value = name_of(field), problem["type"], problem.get("ctx", {}), problem.get("input")
    info = section_fields(cls).get(field)
    unit = field_extra(info).get("unit") if info else None
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        return f"unknown setting {name}"
    if kind == "literal_error":
        choices = ", ".join(str(arg) for arg in typing.get_args(value_types(info)[0])) if info else ctx["expected"]
        return f"{name} must be one of {choices}, got {value!r}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        bound = next(iter(ctx.values()))
        if kind == "greater_than" and bound == 0:
            return f"{name} must be {f'a positive number of {unit}' if unit else 'positive'}, got {value}"
        if kind == "greater_than_equal" and bound == 0:
            return f"{name} must not be negative, got {value}"
        words = {"greater_than": "more than", "greater_than_equal": "at least", "less_than": "less than",
                 "less_than_equal": "at most"}[kind]
        return f"{name} must be {words} {bound}{f' {unit}' if unit else ''}, got {value}"
    if info is not None and kind.endswith(("_type", "_parsing")):
        wanted = " or ".join(getattr(t, "__name__", str(t)) for t in value_types(info))
        return f"{name} must be {wanted}, got {value!r}"
    return f"{name}: {problem['msg'].lower()}, got {value!r}"

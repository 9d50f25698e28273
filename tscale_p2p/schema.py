"""Checking what comes from files with pydantic, refusing it in one line that names the bad field.

`validated(schema, value, what)` runs a pydantic model or `TypeAdapter` over a decoded JSON value (a checkpoint's
meta.json, its model config, a trainer's resume state) and turns the first error into a `UserError` such as
``checkpoint runs/a/step-00000100: meta.json field files.model.safetensors.bytes: Input should be a valid
integer, got 'ten'``.
"""

from __future__ import annotations

import reprlib
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from tscale_p2p.errors import UserError

_SHOWN = reprlib.Repr()  # a bad value quoted in a message, kept short (Python 3.11's Repr takes no arguments)
_SHOWN.maxstring = _SHOWN.maxother = 60


def validated(schema: type[BaseModel] | TypeAdapter, value: Any, what: str) -> Any:
    """`value` checked (and converted) by `schema`; UserError ``WHAT field F: PROBLEM, got V`` otherwise."""
    try:
        if isinstance(schema, TypeAdapter):
            return schema.validate_python(value)
        return schema.model_validate(value)
    except ValidationError as error:
        raise UserError(f"{what}: {describe(error)}") from None


def describe(error: ValidationError) -> str:
    """pydantic's first error in one line: where (dotted), what is wrong, and the value found there."""
    first = error.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first["loc"])
    found = "" if first["type"] == "missing" else f", got {_SHOWN.repr(first['input'])}"
    return f"field {where}: {first['msg']}{found}" if where else f"{first['msg']}{found}"

"""Manifests as plain JSON data: strict reading (dataclasses from parsed JSON, naming the dotted
path of the first bad field) and writing (dataclasses to plain data).

Reading is bounded whatever the input: duplicate keys, JSON constants (NaN, Infinity) and
integers longer than any field admits are refused before conversion (a 5000-digit integer is
never parsed), arrays are length-checked before their items are read, and bad values are
echoed in at most ~100 characters (`services.echo`). Field rules live with the contracts in
`services.kvpolicy.manifest`; this module knows types, and the names of renamed fields.
"""

from __future__ import annotations

import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, fields, is_dataclass
from enum import StrEnum
from typing import Any, get_type_hints

from services.echo import echo
from services.kvpolicy.errors import ManifestInvalid

MAX_KEY_CHARS = 64  # a JSON object key echoed as a path element
MAX_ARRAY_ITEMS = 1024  # the longest array of a manifest is q_to_kv_head_map, [H_q]
_MAX_INT_DIGITS = 24


def _fail(path: str, message: str) -> typing.NoReturn:
    raise ManifestInvalid(path, message)


def load_json(text: str | bytes) -> Any:
    """Parsed JSON with duplicate keys, constants and over-long integers refused."""
    return json.loads(
        text,
        object_pairs_hook=_no_duplicate_keys,
        parse_constant=_no_constants,
        parse_int=_parse_int,
    )


# Fields renamed since they were published: reading the old name would guess at its meaning.
_RENAMED = {
    "selection.allocation.alpha": "renamed uniform_share (its meaning: the share of the layer"
    " budget spread uniformly; the Ada-KV paper's alpha is 1 - uniform_share)",
}


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def from_plain(cls: type, data: Any, path: str) -> Any:
    """Convert plain data to dataclass `cls`, naming the dotted path of the first bad field."""
    if not isinstance(data, Mapping):
        _fail(path or "manifest", f"expected an object, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        sub = _join(path, _key(unknown[0]))
        _fail(sub, _RENAMED.get(sub, "unknown field"))
    hints = get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        sub = _join(path, f.name)
        if f.name in data:
            kwargs[f.name] = _convert(hints[f.name], data[f.name], sub)
        elif f.default is MISSING and f.default_factory is MISSING:
            _fail(sub, "missing required field")
    return cls(**kwargs)


def _convert(tp: Any, value: Any, path: str) -> Any:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _convert(inner, value, path)
    if typing.get_origin(tp) is tuple:
        if not isinstance(value, list | tuple):
            _fail(path, f"expected an array, got {type(value).__name__}")
        if len(value) > MAX_ARRAY_ITEMS:  # the longest array is q_to_kv_head_map, [H_q]
            _fail(path, f"has {len(value)} entries, more than the limit of {MAX_ARRAY_ITEMS}")
        item_type = typing.get_args(tp)[0]
        return tuple(_convert(item_type, v, f"{path}[{i}]") for i, v in enumerate(value))
    if isinstance(tp, type) and issubclass(tp, StrEnum):
        allowed = [m.value for m in tp]
        if not isinstance(value, str) or value not in allowed:
            _fail(path, f"unknown value {echo(value)}; expected one of {allowed}")
        return tp(value)
    if isinstance(tp, type) and is_dataclass(tp):
        return from_plain(tp, value, path)
    return _convert_scalar(tp, value, path)


def _convert_scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is bool:
        if not isinstance(value, bool):
            _fail(path, f"expected a boolean, got {echo(value)}")
        return value
    if tp is int:
        if isinstance(value, _LongInteger):
            _fail(path, f"{value!r} is out of range")
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(path, f"expected an integer, got {echo(value)}")
        return value
    if tp is float:
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            _fail(path, f"expected a finite number, got {echo(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            _fail(path, f"expected a string, got {echo(value)}")
        return value
    raise TypeError(f"unsupported manifest field type {tp!r} at {path}")


def normalize(obj: Any, prefix: str) -> None:
    """Accept plain strings for enum fields and lists for tuple fields from Python callers."""
    hints = get_type_hints(type(obj))
    for f in fields(obj):
        tp, value = hints[f.name], getattr(obj, f.name)
        if isinstance(value, list) or (
            isinstance(value, str) and not isinstance(value, StrEnum) and _is_enum_type(tp)
        ):
            object.__setattr__(obj, f.name, _convert(tp, value, _join(prefix, f.name)))


def _is_enum_type(tp: Any) -> bool:
    candidates = typing.get_args(tp) if isinstance(tp, types.UnionType) else (tp,)
    return any(isinstance(c, type) and issubclass(c, StrEnum) for c in candidates)


# A field added after manifests were published carries this metadata: left null, it is left
# out of the plain data, so every manifest written before it keeps its canonical JSON (identity).
OMIT_IF_NULL = {"omit_if_null": True}


def to_plain(obj: Any) -> Any:
    if is_dataclass(obj) and not isinstance(obj, type):
        return {
            f.name: to_plain(getattr(obj, f.name))
            for f in fields(obj)
            if not (f.metadata.get("omit_if_null") and getattr(obj, f.name) is None)
        }
    if isinstance(obj, StrEnum):
        return obj.value
    if isinstance(obj, tuple | list):
        return [to_plain(v) for v in obj]
    return obj


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            _fail(_key(key), "duplicate key in JSON object")
        out[key] = value
    return out


def _key(key: str) -> str:
    """A JSON object key as a field path element: bounded like an echoed value."""
    return key if len(key) <= MAX_KEY_CHARS else f"{key[:MAX_KEY_CHARS]}…"


class _LongInteger:
    """A JSON integer too long for any field, kept unparsed: converting a 5000-digit string
    costs time (Python refuses past 4300 digits) and no bound admits it anyway."""

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


def _parse_int(text: str) -> int | _LongInteger:
    digits = len(text.lstrip("-"))
    return _LongInteger(digits) if digits > _MAX_INT_DIGITS else int(text)


def _no_constants(token: str) -> Any:
    _fail("manifest", f"JSON constant {token} is not allowed")

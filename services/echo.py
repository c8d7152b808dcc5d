"""Bounded echoes of bad values in error messages.

An error names the field and says what is wrong with it; when it quotes the offending value,
it quotes at most about `ECHO_CHARS` characters of it, through `echo`. A 10 KB policy name
must not become a 10 KB gRPC trailer (clients refuse metadata over 8 KB and report
RESOURCE_EXHAUSTED instead of the real error), nor ten million head indices an 89 MB string.
`echo` stays cheap for huge values: a long string or sequence is cut before it is formatted,
and an integer too long to print (Python refuses str() past 4300 digits) is described by its
size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Set

ECHO_CHARS = 100
_LOG10_2 = math.log10(2)


def echo(value: object, limit: int = ECHO_CHARS) -> str:
    """`repr(value)` in at most about `limit` characters, saying how much was left out."""
    try:
        return _echo(value, limit)
    except (RecursionError, ValueError):  # a deeply nested value; an int past the str() limit
        return f"<a {type(value).__name__}>"


def _echo(value: object, limit: int) -> str:
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        digits = int(value.bit_length() * _LOG10_2) + 1
        return repr(value) if digits <= limit else f"<an integer of about {digits} digits>"
    if isinstance(value, str | bytes | bytearray):
        unit = "characters" if isinstance(value, str) else "bytes"
        if len(value) <= limit:
            return repr(value)
        return f"{truncated(repr(value[:limit]), limit + 3)}… ({len(value)} {unit})"
    if isinstance(value, list | tuple):
        return _items(value, limit)
    if isinstance(value, Mapping | Set):
        return f"<a {type(value).__name__} of {len(value)} items>"
    return truncated(repr(value), limit)


def _items(value: list[object] | tuple[object, ...], limit: int) -> str:
    """Items echoed one by one until `limit` characters are used (never the whole list)."""
    parts: list[str] = []
    used = 0
    for item in value[:limit]:
        if used >= limit:
            break
        part = _echo(item, limit - used)
        parts.append(part)
        used += len(part) + 2
    opening, closing = "[]" if isinstance(value, list) else "()"
    if len(parts) < len(value):
        return f"{opening}{', '.join(parts)}, …{closing} ({len(value)} items)"
    trailing = "," if isinstance(value, tuple) and len(value) == 1 else ""
    return f"{opening}{', '.join(parts)}{trailing}{closing}"


def truncated(text: str, limit: int = ECHO_CHARS) -> str:
    """`text` itself (not its repr) cut to `limit` characters: for listings in messages."""
    return text if len(text) <= limit else f"{text[:limit]}…"

"""`echo`: a bad value quoted in an error message in about 100 characters, cheaply, whatever it is."""

from __future__ import annotations

import time

import pytest

from services.echo import ECHO_CHARS, echo, truncated

BOUND = ECHO_CHARS + 60  # quotes, ellipses and "(N characters), …) (N items)"


def nested(depth: int) -> list[object]:
    outer: list[object] = []
    inner = outer
    for _ in range(depth):
        child: list[object] = []
        inner.append(child)
        inner = child
    return outer


@pytest.mark.parametrize(
    "value",
    ["x" * 10**7, b"\xff" * 10**6, list(range(10**6)), tuple(["y" * 10**6] * 100), 10**5000, -(10**5000),
     {"k": 1} , set(range(10**5)), nested(100_000), [[["z" * 10**6]]]],
    ids=["10M chars", "1M bytes", "1M ints", "100 x 1M chars", "5000 digits", "-5000 digits", "dict", "set",
         "100K deep", "nested long string"],
)
def test_huge_values_echo_in_bounded_text_quickly(value: object) -> None:
    started = time.perf_counter()
    text = echo(value)
    assert len(text) <= BOUND, text[:300]
    assert time.perf_counter() - started < 0.05


def test_small_values_echo_as_their_repr() -> None:
    for value in ("snapkv", b"ab", 7, -3, 1.5, None, True, [0, 1, 1], (1,), ()):
        assert echo(value) == repr(value)
    assert echo(2**63) == "9223372036854775808"


def test_what_was_cut_is_said() -> None:
    assert echo("x" * 10_000).endswith("(10000 characters)")
    assert echo(list(range(1000))).endswith("…] (1000 items)")
    assert echo(10**5000) == "<an integer of about 5001 digits>"
    assert truncated("a, b, c", 4) == "a, b…" and truncated("abc") == "abc"

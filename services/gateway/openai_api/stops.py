"""Stop strings: the output ends just before the first of them to occur (the one that
completes first; of two completing at the same character, the longer).

The workers stop at token ids; a stop string can span tokens, so it is matched on the text
the gateway streams. `StopMatcher.feed` takes each text delta and returns what may be sent
now: text that cannot be the beginning of a stop string. A tail that could be is held back
until the next delta decides, so the client never sees a piece of a stop string (vLLM's
rule). Pure: the HTTP front asks the orchestrator to end the stream once `matched` is set.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.echo import echo
from services.rpc.errors import InvalidArgument

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256


def check_stops(stops: Sequence[str], field: str = "stop") -> tuple[str, ...]:
    """The stop strings of a request; InvalidArgument naming `stop` or `stop[i]`."""
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"{len(stops)} stop strings exceeds the limit of {MAX_STOP_STRINGS}", field=field)
    for index, stop in enumerate(stops):
        where = f"{field}[{index}]" if len(stops) > 1 else field
        if not stop:
            raise InvalidArgument("must not be empty", field=where)
        if len(stop) > MAX_STOP_CHARS:
            raise InvalidArgument(f"{echo(stop, 40)} is longer than {MAX_STOP_CHARS} characters", field=where)
    return tuple(stops)


class StopMatcher:
    """The first stop string in a stream of text deltas."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.matched = False
        self._held = ""

    def feed(self, delta: str) -> str:
        """The text that may be emitted now; "" once a stop string has matched."""
        if self.matched:
            return ""
        text = self._held + delta
        # The match that completes first (the longest of those ending at the same place): the
        # same cut however the text was split into deltas.
        found = [(index + len(stop), index) for stop in self.stops if (index := text.find(stop)) >= 0]
        if found:
            self.matched, self._held = True, ""
            return text[: min(found)[1]]
        keep = self._prefix_tail(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The text held back at the end of a stream that no stop string completed."""
        held, self._held = self._held, ""
        return "" if self.matched else held

    def _prefix_tail(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest

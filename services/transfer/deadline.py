"""Deadlines: absolute points on the monotonic clock that every transfer wait is bounded by."""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

# gloo reads a zero or negative timeout as "use the context default" (minutes), so a wait
# is never handed less than this.
_MIN_WAIT = datetime.timedelta(milliseconds=1)


@dataclass(frozen=True)
class Deadline:
    """The `time.monotonic()` instant by which a wait must have returned."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        """The deadline `seconds` from now."""
        if seconds < 0:
            raise ValueError(f"seconds: must be >= 0, got {seconds}")
        return cls(time.monotonic() + seconds)

    def remaining(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def timedelta(self) -> datetime.timedelta:
        """Time left as a torch.distributed timeout (at least 1 ms)."""
        return max(_MIN_WAIT, datetime.timedelta(seconds=self.remaining()))

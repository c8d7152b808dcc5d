"""How busy the host was while a benchmark ran: the hosts here are shared, and a latency
report read without that is misleading. `HostLoad.start()` before the run, `describe()` after:
CPUs, the 1-minute load average at the start and the share of CPU time the hypervisor took
(steal, from /proc/stat; omitted where there is none)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_PROC_STAT = Path("/proc/stat")
_STEAL = 7  # user nice system idle iowait irq softirq steal ...


def _cpu_times() -> list[int] | None:
    try:
        fields = _PROC_STAT.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if fields[0] != "cpu" or len(fields) <= _STEAL + 1:
        return None
    return [int(value) for value in fields[1:]]


@dataclass(frozen=True)
class HostLoad:
    load_1min: float
    cpu_times: list[int] | None

    @classmethod
    def start(cls) -> HostLoad:
        return cls(os.getloadavg()[0], _cpu_times())

    def steal_share(self) -> float | None:
        """Stolen CPU time over all CPU time since `start` (None: not known here)."""
        now = _cpu_times()
        if self.cpu_times is None or now is None:
            return None
        spent = [b - a for a, b in zip(self.cpu_times, now, strict=False)]
        total = sum(spent)
        return spent[_STEAL] / total if total > 0 else None

    def describe(self, where: str = "loopback") -> str:
        steal = self.steal_share()
        stolen = f", CPU steal {100 * steal:.1f}% during the run" if steal is not None else ""
        return f"{os.cpu_count()} CPUs, {where}, 1-min load average {self.load_1min:.1f} at the start{stolen}"

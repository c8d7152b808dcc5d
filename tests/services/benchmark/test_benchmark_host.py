"""services.benchmark.host: what a report says about how busy its host was."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import services.benchmark.host as host
from services.benchmark.host import HostLoad


def write_stat(path: Path, user: int, idle: int, steal: int) -> None:
    path.write_text(f"cpu  {user} 0 10 {idle} 0 0 0 {steal} 0 0\ncpu0 1 0 1 1 0 0 0 0 0 0\n")


def test_steal_is_the_share_of_cpu_time_taken_during_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stat = tmp_path / "stat"
    monkeypatch.setattr(host, "_PROC_STAT", stat)
    write_stat(stat, user=100, idle=1000, steal=5)
    load = HostLoad.start()
    write_stat(stat, user=170, idle=1010, steal=25)  # 70 user + 10 idle + 20 stolen
    assert load.steal_share() == pytest.approx(20 / 100)
    text = load.describe()
    assert text.startswith(f"{os.cpu_count()} CPUs, loopback, 1-min load average ")
    assert text.endswith("CPU steal 20.0% during the run")


def test_a_host_without_proc_stat_reports_no_steal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host, "_PROC_STAT", tmp_path / "absent")
    load = HostLoad.start()
    assert load.steal_share() is None and "steal" not in load.describe("a cluster")
    assert ", a cluster, " in load.describe("a cluster")

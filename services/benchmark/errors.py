"""Typed errors of `kvrelay bench`. Each names the option, package or process at fault."""

from __future__ import annotations


class BenchError(Exception):
    """Base class of every error the benchmark harness raises."""


class InvalidBenchConfig(BenchError, ValueError):
    """A bench option is malformed or contradicts another (`field` names it)."""

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"invalid bench option {field!r}: {reason}")


class MissingBenchDependency(BenchError, ImportError):
    """An optional package the requested measurement needs is not installed."""

    def __init__(self, package: str, needed_for: str, hint: str) -> None:
        self.package = package
        super().__init__(f"`kvrelay bench` needs the package {package!r} for {needed_for}: {hint}")


class EngineFailed(BenchError, RuntimeError):
    """A measurement subprocess died, timed out or reported an exception."""

    def __init__(self, process: str, reason: str) -> None:
        self.process = process
        super().__init__(f"bench measurement process {process!r} failed: {reason}")

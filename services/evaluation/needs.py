"""Optional packages of the evaluation commands, imported on first use with an error naming them."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingDependency(RuntimeError):
    """A package an evaluation step needs is not importable; the message names it."""

    def __init__(self, package: str, install: str, cause: BaseException) -> None:
        super().__init__(
            f"this step needs the package `{package}` (pip install {install}): "
            f"{type(cause).__name__}: {cause}"
        )
        self.package = package


def require(package: str, install: str | None = None) -> ModuleType:
    """`import package`, or MissingDependency naming it and how to install it."""
    try:
        return importlib.import_module(package)
    except ImportError as exc:
        raise MissingDependency(package, install or package, exc) from exc

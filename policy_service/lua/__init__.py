"""The policy service's Redis Lua scripts: one script per mutation, each atomic.

`load(name)` returns `prelude.lua` (shared helpers) followed by `<name>.lua`.
"""

from __future__ import annotations

from importlib import resources

SCRIPT_NAMES = ("register_manifest", "begin_request", "publish_state", "get_fence", "end_request")


def load(name: str) -> str:
    """Source of script `name`, with the shared prelude prepended."""
    if name not in SCRIPT_NAMES:
        raise KeyError(f"no Lua script named {name!r}; known: {SCRIPT_NAMES}")
    package = resources.files(__package__)
    return (package / "prelude.lua").read_text() + "\n" + (package / f"{name}.lua").read_text()

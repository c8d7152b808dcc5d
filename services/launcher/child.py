"""Entry point of every service the launcher starts:

    python -m services.launcher.child <launcher pid> serve <role> [flags...]

It asks Linux to SIGTERM it when the launcher dies (`PR_SET_PDEATHSIG`), exits at once if
the launcher is already gone, then runs the `kvrelay` command line in this process. Done here,
after exec, rather than in a `preexec_fn`, which is unsafe in a multi-threaded launcher.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with(parent_pid: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the launcher died before the request took effect
        sys.exit(f"kvrelay launcher {parent_pid} is gone; not starting")


def main(argv: list[str]) -> None:
    die_with(int(argv[0]))
    from kvrelay.cli import app

    app(argv[1:], prog_name="kvrelay")


if __name__ == "__main__":
    main(sys.argv[1:])

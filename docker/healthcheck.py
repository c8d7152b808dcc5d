"""Container health check of a kvrelay image: is the gRPC health of the service in this
container SERVING?

One image runs every role (`kvrelay serve policy|prefill|decode|gateway`), each on its own
port, and the port may come from a flag, an environment variable or the default. Rather than
repeat those, this script reads the container's command line (`/proc/1/cmdline`, or the
arguments given to it), lets the `kvrelay` CLI itself parse that command, and asks the gRPC
health service (overall status, service "") at the resulting host and port.

Exit status 0: SERVING; 1: anything else (not serving, unreachable, timed out, not a service).
Usage: `python healthcheck.py [kvrelay serve ROLE [ARGS...]]`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
import typer
from grpc_health.v1 import health_pb2, health_pb2_grpc

_WILDCARDS = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}


class NotAService(ValueError):
    """The command line is not `... serve ROLE ...` with a known role."""


def served_command(cmdline: Sequence[str]) -> tuple[str, list[str]]:
    """The role and its arguments in a command line such as
    `tini -- /opt/venv/bin/python /opt/venv/bin/kvrelay serve decode --port 50063`."""
    args = list(cmdline)
    if "serve" not in args or args.index("serve") + 1 >= len(args):
        raise NotAService(f"no `serve ROLE` in {' '.join(args)!r}")
    at = args.index("serve")
    return args[at + 1], args[at + 2 :]


def listen_address(role: str, args: Sequence[str]) -> str:
    """host:port that `kvrelay serve ROLE ARGS` listens on, resolved by the CLI's own parser
    (flags, then `KVRELAY_<ROLE>_*` environment variables, then defaults)."""
    from kvrelay.cli import app

    serve = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    if role not in serve.commands:
        raise NotAService(f"unknown role {role!r}; known: {sorted(serve.commands)}")
    params = serve.commands[role].make_context(role, list(args)).params
    host = _WILDCARDS.get(params["host"], params["host"])
    return f"[{host}]:{params['port']}" if ":" in host else f"{host}:{params['port']}"


def probe(address: str, timeout_s: float) -> str:
    """The overall gRPC health status name at `address` (e.g. "SERVING")."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: Sequence[str]) -> int:
    cmdline = list(argv) or Path("/proc/1/cmdline").read_bytes().decode().rstrip("\0").split("\0")
    timeout_s = float(os.environ.get("KVRELAY_HEALTHCHECK_TIMEOUT_S", "3"))
    try:
        address = listen_address(*served_command(cmdline))
    except Exception as exc:  # not `serve ROLE`, or arguments the CLI itself rejects
        print(f"unhealthy: no service address: {exc}", file=sys.stderr)
        return 1
    try:
        status = probe(address, timeout_s)
    except grpc.RpcError as exc:
        print(f"unhealthy: {exc.code().name} from {address}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    print(f"{address} {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

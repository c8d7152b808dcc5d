"""Container health check of a kvrelay image: is the gRPC health of the service in this
container SERVING?

One image runs every role (`kvrelay serve policy|prefill|decode|gateway`), each on its own
port, and the port may come from a flag, an environment variable or the default. Rather than
repeat those, this script reads the container's command line (`/proc/1/cmdline`, or the
arguments given to it), lets the `kvrelay` CLI itself parse that command, and asks the gRPC
health service (overall status, service "") at the resulting host and port.

It speaks the transport the service does, from the same flags or `KVRELAY_TLS_*` variables:
TLS with the container's own certificate and key as its client certificate (so an mTLS server
admits it) and the server's certificate checked for the role's name, `<role>.kvrelay.internal`;
plaintext only when the serve command asks for `--plaintext` (`KVRELAY_PLAINTEXT`). That is
why Kubernetes runs this script as an exec probe: kubelet's own gRPC probe speaks no TLS.

Exit status 0: SERVING; 1: anything else (not serving, unreachable, timed out, not a service).
Usage: `python healthcheck.py [kvrelay serve ROLE [ARGS...]]`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import typer
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.security.roles import Role
from services.security.transport import TransportConfigError, TransportSecurity

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


def service_params(role: str, args: Sequence[str]) -> dict[str, Any]:
    """The parameters `kvrelay serve ROLE ARGS` runs with, resolved by the CLI's own parser
    (flags, then `KVRELAY_*` environment variables, then defaults)."""
    from kvrelay.cli import app

    serve = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    if role not in serve.commands:
        raise NotAService(f"unknown role {role!r}; known: {sorted(serve.commands)}")
    return dict(serve.commands[role].make_context(role, list(args)).params)


def listen_address(role: str, args: Sequence[str]) -> str:
    """host:port that `kvrelay serve ROLE ARGS` listens on (a wildcard host: its loopback)."""
    return address_of(service_params(role, args))


def address_of(params: dict[str, Any]) -> str:
    """host:port to dial for a serve command's parameters."""
    host = _WILDCARDS.get(params["host"], params["host"])
    return f"[{host}]:{params['port']}" if ":" in host else f"{host}:{params['port']}"


def transport(params: dict[str, Any]) -> TransportSecurity:
    """The service's own transport, as a client of it: plaintext only when it serves plaintext,
    else TLS presenting the service's certificate (TransportConfigError naming a bad file)."""
    if params["plaintext"]:
        return TransportSecurity(plaintext=True,
                                 allow_remote_plaintext=params["allow_remote_plaintext"])
    return TransportSecurity.from_files(cert=params["tls_cert"], key=params["tls_key"],
                                        ca=params["tls_ca"])


def probe(address: str, role: str, security: TransportSecurity, timeout_s: float) -> str:
    """The overall gRPC health status name of `role`'s service at `address` (e.g. "SERVING")."""
    with security.channel(address, Role(role)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: Sequence[str]) -> int:
    cmdline = list(argv) or Path("/proc/1/cmdline").read_bytes().decode().rstrip("\0").split("\0")
    timeout_s = float(os.environ.get("KVRELAY_HEALTHCHECK_TIMEOUT_S", "3"))
    try:
        role, args = served_command(cmdline)
        params = service_params(role, args)
        address = address_of(params)
    except Exception as exc:  # not `serve ROLE`, or arguments the CLI itself rejects
        print(f"unhealthy: no service address: {exc}", file=sys.stderr)
        return 1
    try:
        status = probe(address, role, transport(params), timeout_s)
    except TransportConfigError as exc:  # unreadable TLS files, or plaintext off loopback
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    except grpc.RpcError as exc:
        print(f"unhealthy: {exc.code().name} from {address}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    print(f"{address} {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

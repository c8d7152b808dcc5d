"""The transport-security flags every `kvrelay serve` command and every client command takes,
defined once. A server without TLS material refuses to start unless `--plaintext` is asked for;
a client without a CA speaks plaintext, which `TransportSecurity` allows only to loopback."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:  # imported when a command runs: `kvrelay --help` does not load grpc
    from services.security.transport import TransportSecurity

TLS_CERT = typer.Option(None, "--tls-cert", envvar="KVRELAY_TLS_CERT", help="PEM certificate of this process (`kvrelay certs` makes a development set).")
TLS_KEY = typer.Option(None, "--tls-key", envvar="KVRELAY_TLS_KEY", help="PEM private key of --tls-cert.")
TLS_CA = typer.Option(None, "--tls-ca", envvar="KVRELAY_TLS_CA", help="PEM CA that peers' certificates must chain to.")
PLAINTEXT = typer.Option(False, "--plaintext", envvar="KVRELAY_PLAINTEXT", help="No TLS: loopback only, every caller may do everything (development).")
REMOTE_PLAINTEXT = typer.Option(False, "--allow-remote-plaintext", envvar="KVRELAY_ALLOW_REMOTE_PLAINTEXT", help="With --plaintext: also on non-loopback interfaces (a trusted network; not recommended).")
AUTH_TOKENS = typer.Option(None, "--auth-tokens", envvar="KVRELAY_AUTH_TOKENS", help="Bearer tokens / API keys this server accepts: '<sha256> <name> <role>[,<role>]' per line (`kvrelay token`).")
AUTH_TOKEN = typer.Option("", "--auth-token", envvar="KVRELAY_AUTH_TOKEN", help="Bearer token this process sends to its peers (where it has no client certificate).")
REQUIRE_CLIENT_CERT = typer.Option(True, "--require-client-cert/--no-require-client-cert", envvar="KVRELAY_TLS_REQUIRE_CLIENT_CERT", help="Refuse, in the TLS handshake, callers without a certificate from --tls-ca (off: callers authenticate by --auth-tokens).")
GATEWAY_CLIENT_CERT = typer.Option(False, "--require-client-cert/--no-require-client-cert", envvar="KVRELAY_TLS_REQUIRE_CLIENT_CERT", help="Refuse callers without a client certificate from --tls-ca (default off: clients use API keys from --auth-tokens, or none).")
API_KEY = typer.Option("", "--api-key", envvar="KVRELAY_API_KEY", help="API key for the gateway's Generate (sent as a bearer token).")


def server_security(
    command: str, *, cert: Path | None, key: Path | None, ca: Path | None, plaintext: bool,
    remote_plaintext: bool, tokens: Path | None, token: str, require_client_cert: bool,
) -> TransportSecurity:
    """The process's TransportSecurity from its flags; exit 2 naming the flag when unusable."""
    from services.security.tokens import TokenFileError
    from services.security.transport import TransportConfigError, TransportSecurity

    try:
        return TransportSecurity.from_files(
            cert=cert, key=key, ca=ca, plaintext=plaintext, require_client_cert=require_client_cert,
            tokens_file=tokens, bearer_token=token, allow_remote_plaintext=remote_plaintext)
    except (TransportConfigError, TokenFileError) as exc:
        typer.echo(f"kvrelay {command}: --{exc.field.replace('_', '-')}: {str(exc).split(': ', 1)[-1]}", err=True)
        raise typer.Exit(2) from None


def client_security(command: str, *, cert: Path | None, key: Path | None, ca: Path | None,
                    token: str = "") -> TransportSecurity:
    """A client's TransportSecurity: TLS when a CA is given, else plaintext (loopback only)."""
    from services.security.transport import TransportSecurity

    if ca is None and cert is None and key is None:
        return TransportSecurity.local_plaintext()
    return server_security(command, cert=cert, key=key, ca=ca, plaintext=False, remote_plaintext=False,
                           tokens=None, token=token, require_client_cert=True)


def with_transport_security(*, gateway: bool = False) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a `kvrelay serve` command the transport-security flags above: the command takes a
    `security: TransportSecurity` argument, built from them (exit 2 naming a flag that cannot
    work). `gateway`: its port asks for no client certificate by default (clients use API keys)."""
    flags = {
        "tls_cert": (Path | None, TLS_CERT), "tls_key": (Path | None, TLS_KEY),
        "tls_ca": (Path | None, TLS_CA), "plaintext": (bool, PLAINTEXT),
        "allow_remote_plaintext": (bool, REMOTE_PLAINTEXT), "auth_tokens": (Path | None, AUTH_TOKENS),
        "auth_token": (str, AUTH_TOKEN),
        "require_client_cert": (bool, GATEWAY_CLIENT_CERT if gateway else REQUIRE_CLIENT_CERT),
    }

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        name = f"serve {command.__name__.removeprefix('serve_')}"

        @functools.wraps(command)
        def run(**kwargs: Any) -> None:
            given = {flag: kwargs.pop(flag) for flag in flags}
            kwargs["security"] = server_security(
                name, cert=given["tls_cert"], key=given["tls_key"], ca=given["tls_ca"],
                plaintext=given["plaintext"], remote_plaintext=given["allow_remote_plaintext"],
                tokens=given["auth_tokens"], token=given["auth_token"],
                require_client_cert=given["require_client_cert"])
            command(**kwargs)

        # Typer reads the signature and the annotations: `security` is this wrapper's to give.
        run.__annotations__ = {k: v for k, v in command.__annotations__.items() if k != "security"}
        signature = inspect.signature(command)
        own = [p for p in signature.parameters.values() if p.name != "security"]
        added = [inspect.Parameter(flag, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind)
                 for flag, (kind, option) in flags.items()]
        run.__signature__ = signature.replace(parameters=[  # type: ignore[attr-defined]
            *(p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own), *added])
        return run

    return decorate

"""How a kvrelay process speaks gRPC: TLS with client certificates (the default for every
internal hop), TLS with bearer tokens (where mTLS is not available), or plaintext — only when
explicitly asked for, and then only on loopback unless remote plaintext is asked for too.

One `TransportSecurity` per process serves both directions: its certificate is the server's
certificate and the client certificate it presents to its peers. A client names the role of
the service it calls, and the channel checks the server's certificate for that role's name,
`<role>.kvrelay.internal` (`server_name`): workers advertise pod IPs, which no certificate
lists, and a certificate issued for a prefill worker must not pass for the policy service.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from services.security.roles import Role
from services.security.tokens import TokenTable

SERVER_NAME_DOMAIN = "kvrelay.internal"
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


class TransportConfigError(ValueError):
    """A security setting that cannot work; `field` names the flag (or its variable)."""

    def __init__(self, message: str, *, field: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


def server_name(role: Role) -> str:
    """The DNS name every certificate of `role` carries and every client to it checks."""
    return f"{role.value}.{SERVER_NAME_DOMAIN}"


def is_loopback(host: str) -> bool:
    """True for localhost names and loopback addresses (IPv4 127/8, IPv6 ::1)."""
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def target_host(target: str) -> str:
    """The host part of a gRPC target: host:port, [v6]:port, dns:///host:port, ipv4:host:port."""
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target[len(scheme):]
            break
    if target.startswith("["):
        return target[1:target.find("]")] if "]" in target else target
    host, sep, _port = target.rpartition(":")
    return host if sep else target


@dataclass(frozen=True)
class TransportSecurity:
    """A process's gRPC transport security (immutable; built once from flags or tests).

    `plaintext`: no TLS; `allow_remote_plaintext` lifts the loopback-only rule.
    With TLS: `cert_chain`/`private_key` (PEM) are this process's certificate (may be empty on
    a client that authenticates by `bearer_token`), `root_certs` the CA that peers' certificates
    must chain to. `require_client_cert` makes the server refuse, in the handshake, a client
    without a certificate from that CA. `tokens` are the bearer tokens (and API keys) the
    server accepts; `bearer_token` is what this process sends as a client."""

    plaintext: bool = False
    cert_chain: bytes = field(default=b"", repr=False)
    private_key: bytes = field(default=b"", repr=False)
    root_certs: bytes = field(default=b"", repr=False)
    require_client_cert: bool = True
    tokens: TokenTable = field(default_factory=TokenTable)
    bearer_token: str = field(default="", repr=False)
    allow_remote_plaintext: bool = False

    def __post_init__(self) -> None:
        if self.plaintext:
            if self.cert_chain or self.private_key or self.root_certs:
                raise TransportConfigError("plaintext was asked for together with TLS material",
                                           field="plaintext")
            if self.bearer_token:
                raise TransportConfigError("a bearer token is sent only over TLS", field="auth_token")
            return
        if not self.root_certs:
            raise TransportConfigError(
                "TLS needs the CA that peers' certificates chain to (or ask for --plaintext)",
                field="tls_ca")
        if bool(self.cert_chain) != bool(self.private_key):
            raise TransportConfigError("a certificate needs its key and a key its certificate",
                                       field="tls_key" if self.cert_chain else "tls_cert")

    @classmethod
    def local_plaintext(cls) -> TransportSecurity:
        """Plaintext on loopback: in-process tests and the development stack's default."""
        return cls(plaintext=True)

    @classmethod
    def from_files(cls, *, cert: Path | None, key: Path | None, ca: Path | None,
                   plaintext: bool = False, require_client_cert: bool = True,
                   tokens_file: Path | None = None, bearer_token: str = "",
                   allow_remote_plaintext: bool = False) -> TransportSecurity:
        """Read PEM files; a missing or unreadable file is a TransportConfigError naming it."""
        tokens = TokenTable.from_file(tokens_file) if tokens_file else TokenTable()
        if plaintext:
            given = [name for name, path in (("tls_cert", cert), ("tls_key", key), ("tls_ca", ca))
                     if path is not None]
            if given:
                raise TransportConfigError("plaintext was asked for together with TLS material",
                                           field=given[0])
            return cls(plaintext=True, tokens=tokens, bearer_token=bearer_token,
                       allow_remote_plaintext=allow_remote_plaintext)
        if cert is None and key is None and ca is None:
            raise TransportConfigError(
                "no TLS material: give --tls-cert, --tls-key and --tls-ca (KVRELAY_TLS_CERT, "
                "KVRELAY_TLS_KEY, KVRELAY_TLS_CA; `kvrelay certs` makes a development set) or ask "
                "for --plaintext (KVRELAY_PLAINTEXT=1)", field="tls_cert")
        # A client that authenticates by token has a CA and no certificate of its own.
        return cls(cert_chain=_read(cert, "tls_cert") if cert or key else b"",
                   private_key=_read(key, "tls_key") if cert or key else b"",
                   root_certs=_read(ca, "tls_ca"), require_client_cert=require_client_cert,
                   tokens=tokens, bearer_token=bearer_token)

    @property
    def mode(self) -> str:
        """'plaintext', 'mtls' (client certificates required) or 'tls'."""
        if self.plaintext:
            return "plaintext"
        return "mtls" if self.require_client_cert else "tls"

    @property
    def authenticates(self) -> bool:
        """Whether the server knows who calls: client certificates or a token table. A
        plaintext server without tokens is the loopback development stack: every caller may
        do everything (and the server says so in its log)."""
        return not self.plaintext or bool(self.tokens)

    def check_plaintext(self, host: str, what: str, kind: str) -> None:
        """Plaintext `what` `host` (e.g. "gRPC on" an interface) is refused unless `host` is
        loopback or remote plaintext was asked for."""
        if not (self.allow_remote_plaintext or is_loopback(host)):
            raise TransportConfigError(
                f"plaintext {what} {host!r}, not a loopback {kind}: use TLS, or ask for "
                "--allow-remote-plaintext (KVRELAY_ALLOW_REMOTE_PLAINTEXT=1)", field="plaintext")

    def ssl_context(self, *, server: bool) -> ssl.SSLContext | None:
        """The same TLS for a connection that is not gRPC (the policy service's framed Session
        listener): None for plaintext; else TLS 1.2+, peers checked against `root_certs`, this
        process's certificate presented. A server asks for a client certificate and, under
        `require_client_cert`, refuses a client without one; a client checks the server's
        certificate for the name its role's service carries (`server_name`)."""
        if self.plaintext:
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_verify_locations(cadata=self.root_certs.decode("ascii", errors="replace"))
        if server:
            context.verify_mode = ssl.CERT_REQUIRED if self.require_client_cert else ssl.CERT_OPTIONAL
        if self.cert_chain:
            # The ssl module loads a certificate and its key only from files: a private
            # directory that lives for the call.
            with tempfile.TemporaryDirectory(prefix="kvrelay-tls-") as directory:
                cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
                for path, data in ((cert, self.cert_chain), (key, self.private_key)):
                    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
                        out.write(data)
                context.load_cert_chain(cert, key)
        return context

    # -- server side -------------------------------------------------------------------------

    def bind(self, server: grpc.aio.Server, address: str, host: str) -> int:
        """Add the listening port; refuses plaintext on a non-loopback interface unless asked."""
        if self.plaintext:
            self.check_plaintext(host, "gRPC on", "interface")
            return int(server.add_insecure_port(address))
        if not self.cert_chain:
            raise TransportConfigError("a TLS server needs its certificate and key", field="tls_cert")
        credentials = grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)], root_certificates=self.root_certs,
            require_client_auth=self.require_client_cert)
        return int(server.add_secure_port(address, credentials))

    # -- client side -------------------------------------------------------------------------

    def channel_arguments(self, target: str, peer: Role,
                          options: Sequence[tuple[str, Any]]) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, Any]]]:
        """Credentials (None: plaintext) and options for a channel to `peer`'s service."""
        if self.plaintext:
            self.check_plaintext(target_host(target), "gRPC to", "address")
            return None, list(options)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=self.root_certs, private_key=self.private_key or None,
            certificate_chain=self.cert_chain or None)
        if self.bearer_token:
            credentials = grpc.composite_channel_credentials(
                credentials, grpc.access_token_call_credentials(self.bearer_token))
        return credentials, [*options, ("grpc.ssl_target_name_override", server_name(peer))]

    def aio_channel(self, target: str, peer: Role, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """An asyncio channel to `peer`'s service at `target`."""
        credentials, arguments = self.channel_arguments(target, peer, options)
        if credentials is None:
            return grpc.aio.insecure_channel(target, options=arguments)
        return grpc.aio.secure_channel(target, credentials, options=arguments)

    def channel(self, target: str, peer: Role, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A blocking channel to `peer`'s service at `target` (CLIs, the launcher)."""
        credentials, arguments = self.channel_arguments(target, peer, options)
        if credentials is None:
            return grpc.insecure_channel(target, options=arguments)
        return grpc.secure_channel(target, credentials, options=arguments)


def _read(path: Path | None, name: str) -> bytes:
    if path is None:
        raise TransportConfigError("TLS needs this file too", field=name)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TransportConfigError(f"cannot read {path}: {exc.strerror}", field=name) from None
    if b"-----BEGIN" not in data:
        raise TransportConfigError(f"{path} is not PEM", field=name)
    return data

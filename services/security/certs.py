"""Development certificates: a local CA and one leaf certificate per kvrelay identity.

A leaf names its holder in URI SANs `spiffe://kvrelay/<role>/<name>` (one per role, see
`services.security.roles`) and the hosts it serves in DNS/IP SANs; its extended key usage is
serverAuth and clientAuth, since every kvrelay process both serves and calls. Keys are EC P-256:
generating and handshaking with them is fast, which matters for tests and `kvrelay up --tls`.

    create_ca / issue            pure: PEM bytes in, PEM bytes out
    write_bundle / default_bundle  the on-disk layout `<dir>/ca.pem`, `<dir>/<name>.pem`, ...
    peer_identity_from_pem       the (name, roles) a peer certificate speaks for
"""

from __future__ import annotations

import datetime
import functools
import ipaddress
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.security.roles import Role, roles_from_uris, spiffe_uri
from services.security.transport import server_name

CA_CERT = "ca.pem"
CA_KEY = "ca.key"
# Certificates start this long in the past so a peer whose clock runs a little behind accepts them.
CLOCK_SKEW = datetime.timedelta(minutes=5)
LOOPBACK_HOSTS: tuple[str, ...] = ("localhost", "127.0.0.1", "::1")
# A name becomes a file name and the last segment of a SPIFFE URI: keep it to a safe alphabet.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
_MESSAGE_LIMIT = 200


class CertificateError(ValueError):
    """An unreadable or inconsistent certificate input; `field` names the argument or path."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}"[:_MESSAGE_LIMIT])


@dataclass(frozen=True)
class IdentitySpec:
    """One leaf certificate to issue: who holds it, with which roles, serving which hosts."""

    name: str
    roles: frozenset[Role]
    hosts: tuple[str, ...] = LOOPBACK_HOSTS

    def __post_init__(self) -> None:
        check_name(self.name)
        if not self.roles:
            raise CertificateError("roles", f"identity {self.name!r} needs at least one role")
        for host in self.hosts:
            _general_name(host)


@dataclass(frozen=True)
class BundlePaths:
    """What `write_bundle` wrote (or reused): the CA's files and each identity's cert and key."""

    directory: Path
    ca_cert: Path
    ca_key: Path
    ca_created: bool
    leaves: tuple[tuple[str, Path, Path], ...]  # (name, cert path, key path)


def create_ca(common_name: str, valid_days: int) -> tuple[bytes, bytes]:
    """A self-signed CA certificate and its key, both PEM. It signs leaves only (path length 0)."""
    _check_days(valid_days)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + datetime.timedelta(days=valid_days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def issue(
    ca_cert_pem: bytes,
    ca_key_pem: bytes,
    name: str,
    roles: Iterable[Role],
    hosts: Sequence[str],
    valid_days: int,
) -> tuple[bytes, bytes]:
    """A leaf certificate for `name` signed by the CA, and its key (PEM). SANs: one SPIFFE URI per
    role, then each host as a DNS name or (when it parses as one) an IP address."""
    spec = IdentitySpec(name, frozenset(roles), tuple(hosts))
    _check_days(valid_days)
    ca_cert, ca_key = _load_ca(ca_cert_pem, ca_key_pem)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    not_after = min(now + datetime.timedelta(days=valid_days), ca_cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(_sans(spec)), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(_authority_key_id(ca_cert), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


@functools.lru_cache(maxsize=1024)
def peer_identity_from_pem(cert_pem: bytes) -> tuple[str, frozenset[Role]] | None:
    """The (name, roles) a peer certificate's kvrelay URI SANs name, or None when it names none
    or more than one holder. Cached by the PEM bytes: servers call this on every RPC."""
    cert = _load_cert(cert_pem, "cert_pem")
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    return roles_from_uris(san.get_values_for_type(x509.UniformResourceIdentifier))


def write_bundle(
    directory: Path,
    identities: Sequence[IdentitySpec],
    valid_days: int = 30,
    *,
    reuse_ca: bool = True,
    force: bool = False,
) -> BundlePaths:
    """Write `<dir>/ca.pem`, `<dir>/ca.key` and `<dir>/<name>.pem`, `<dir>/<name>.key` per identity
    (keys 0600). An existing CA is reused when `reuse_ca` (issuing more identities from it);
    otherwise it is replaced only with `force`. An existing leaf is replaced only with `force`.
    Every check runs before anything is written, so a refusal leaves the directory as it was."""
    _check_days(valid_days)
    names = [spec.name for spec in identities]
    if len(set(names)) != len(names):
        raise CertificateError("identities", f"names repeat: {names}")
    ca_cert_path, ca_key_path = directory / CA_CERT, directory / CA_KEY
    ca_exists = ca_cert_path.exists() or ca_key_path.exists()
    if ca_exists and not reuse_ca and not force:
        raise CertificateError(str(ca_cert_path), "a CA exists here; pass --force to replace it")
    create = not ca_exists or not reuse_ca
    if not create:
        ca_cert_pem, ca_key_pem = _read(ca_cert_path), _read(ca_key_path)
        _load_ca(ca_cert_pem, ca_key_pem)
    for name in names:
        for path in (directory / f"{name}.pem", directory / f"{name}.key"):
            if path.exists() and not force:
                raise CertificateError(str(path), "exists; pass --force to replace it")
    directory.mkdir(parents=True, exist_ok=True)
    if create:
        ca_cert_pem, ca_key_pem = create_ca("kvrelay development CA", valid_days)
        _write(ca_key_path, ca_key_pem, 0o600)
        _write(ca_cert_path, ca_cert_pem, 0o644)
    leaves = [_write_leaf(directory, spec, ca_cert_pem, ca_key_pem, valid_days) for spec in identities]
    return BundlePaths(directory, ca_cert_path, ca_key_path, create, tuple(leaves))


def default_identities(hosts: Sequence[str] = ()) -> tuple[IdentitySpec, ...]:
    """The development set: one identity per service and an operator and a client. Each serves
    loopback, its compose and Kubernetes service names, and `hosts`."""
    extra = tuple(hosts)
    return tuple(
        IdentitySpec(name, roles, (*LOOPBACK_HOSTS, *service_hosts(name), *extra))
        for name, roles in _DEFAULT_ROLES
    )


def default_bundle(
    directory: Path, hosts: Sequence[str] = (), valid_days: int = 30, *, force: bool = False
) -> BundlePaths:
    """A new CA and the development set (`default_identities`) in `directory`."""
    return write_bundle(
        directory, default_identities(hosts), valid_days, reuse_ca=False, force=force
    )


def service_hosts(name: str, namespace: str = "kvrelay") -> tuple[str, ...]:
    """The DNS names a service is reached by: its compose service (`policy`), its Kubernetes
    Service (`kvrelay-policy`, also namespace- and cluster-qualified) and, for the headless
    prefill/decode Services, their pods' `<ip-with-dashes>.<service>...` names. First of all
    the role's own name, `<role>.kvrelay.internal`, which every kvrelay client checks whatever
    address it dials (`services.security.transport.server_name`). Not a service: ()."""
    if name not in _SERVICES:
        return ()
    service = f"kvrelay-{name}"
    qualified = (f"{service}.{namespace}", f"{service}.{namespace}.svc",
                 f"{service}.{namespace}.svc.cluster.local")
    pods = (f"*.{qualified[-1]}",) if name in _HEADLESS else ()
    return (server_name(Role(name)), name, service, *qualified, *pods)


def check_name(name: str) -> str:
    """`name` when it is a usable identity name (a file name and a SPIFFE path segment)."""
    if not _NAME.fullmatch(name) or name in ("ca", "."):
        raise CertificateError(
            "name", f"{name!r} must be 1-63 of [A-Za-z0-9._-], start alphanumeric, not 'ca'"
        )
    return name


def parse_role(value: str) -> Role:
    """The `Role` named `value` (a CLI flag's text)."""
    try:
        return Role(value)
    except ValueError:
        allowed = ", ".join(role.value for role in Role)
        raise CertificateError("role", f"{value!r} is not one of {allowed}") from None


_SERVICES = ("policy", "gateway", "prefill", "decode")
_HEADLESS = ("prefill", "decode")  # k8s/base: clusterIP None, pods addressed one by one
_DEFAULT_ROLES: tuple[tuple[str, frozenset[Role]], ...] = (
    ("policy", frozenset({Role.POLICY})),
    # The gateway registers the default manifests at start-up, which needs the operator role.
    ("gateway", frozenset({Role.GATEWAY, Role.OPERATOR})),
    ("prefill", frozenset({Role.PREFILL})),
    ("decode", frozenset({Role.DECODE})),
    ("operator", frozenset({Role.OPERATOR})),
    ("client", frozenset({Role.CLIENT})),
)


def _write_leaf(
    directory: Path, spec: IdentitySpec, ca_cert_pem: bytes, ca_key_pem: bytes, valid_days: int
) -> tuple[str, Path, Path]:
    cert_pem, key_pem = issue(ca_cert_pem, ca_key_pem, spec.name, spec.roles, spec.hosts, valid_days)
    cert_path, key_path = directory / f"{spec.name}.pem", directory / f"{spec.name}.key"
    _write(key_path, key_pem, 0o600)
    _write(cert_path, cert_pem, 0o644)
    return spec.name, cert_path, key_path


def _sans(spec: IdentitySpec) -> list[x509.GeneralName]:
    uris: list[x509.GeneralName] = [
        x509.UniformResourceIdentifier(spiffe_uri(role, spec.name))
        for role in sorted(spec.roles, key=lambda role: role.value)
    ]
    hosts = [_general_name(host) for host in dict.fromkeys(spec.hosts)]
    return uris + hosts


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    labels = host.split(".")
    wildcard = labels[0] == "*" and len(labels) > 1
    if len(host) > 253 or not all(
        _DNS_LABEL.fullmatch(label) for label in (labels[1:] if wildcard else labels)
    ):
        raise CertificateError("hosts", f"{host!r} is neither an IP address nor a DNS name")
    return x509.DNSName(host)


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=cert_sign,
        crl_sign=cert_sign, encipher_only=False, decipher_only=False,
    )


def _authority_key_id(ca_cert: x509.Certificate) -> x509.AuthorityKeyIdentifier:
    try:
        ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    except x509.ExtensionNotFound:
        return x509.AuthorityKeyIdentifier.from_issuer_public_key(_ec_public(ca_cert))
    return x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)


def _load_ca(cert_pem: bytes, key_pem: bytes) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = _load_cert(cert_pem, "ca_cert")
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        raise CertificateError("ca_cert", "has no basic constraints; not a CA") from None
    if not constraints.ca:
        raise CertificateError("ca_cert", "is not a CA certificate")
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise CertificateError("ca_key", f"unreadable: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertificateError("ca_key", f"is {type(key).__name__}, expected an EC key")
    if key.public_key().public_numbers() != _ec_public(cert).public_numbers():
        raise CertificateError("ca_key", "does not match ca_cert's public key")
    return cert, key


def _load_cert(pem: bytes, field: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise CertificateError(field, f"unreadable PEM certificate: {exc}") from None


def _ec_public(cert: x509.Certificate) -> ec.EllipticCurvePublicKey:
    public = cert.public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey):
        raise CertificateError("ca_cert", f"has a {type(public).__name__}, expected an EC key")
    return public


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    # Unencrypted PKCS#8: what grpc's ssl credentials read. The file mode protects it.
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _check_days(valid_days: int) -> None:
    if not 1 <= valid_days <= 3650:
        raise CertificateError("valid_days", f"{valid_days} is outside 1..3650")


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise CertificateError(str(path), f"unreadable: {exc.strerror}") from None


def _write(path: Path, data: bytes, mode: int) -> None:
    # A temporary file in the same directory, then a rename: a reader never sees half a key, and
    # the key is 0600 from its first byte (mkstemp creates it so) rather than chmod-ed after.
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(temp, mode)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise

"""`kvrelay up`: a whole local deployment as separate processes.

    policy service (+ embedded Redis) -> prefill worker(s) + decode worker(s) + gateway

or, with several policy replicas (`policy_replica_ports`, `kvrelay up --policy-replicas N`):

    redis-server -> policy replicas (stateless, all on it) -> workers + gateway

The replicas' addresses reach the gateway and the workers as one comma-separated list, which
their policy clients balance round robin (a call that finds one replica gone is retried on
another). The launcher then runs the redis-server itself (services.redis_embedded, in-memory
unless `KVRELAY_REDIS_DATA_DIR` asks for AOF, as the single policy service's embedded one), so
that a replica's death does not take Redis with it; the supervisor restarts it like a
service. Each replica journals the manifests it has seen stored (its own registrations and,
within a recovery pass, every other replica's) in a file of its own, so a Redis that comes
back empty gets them back from whichever replica notices first, and no two processes append
to one file.

Each service runs as `kvrelay serve <role>` (through `services.launcher.child`) in its own
session, so a Ctrl-C in the terminal reaches only the launcher, which stops the services in
order; its output goes to a log file. The launcher waits until every service's gRPC health
says SERVING, and `stop()` ends everything it started: SIGTERM, then SIGKILL of the
service's process group (an embedded redis-server included) after `stop_timeout_s`. A child
also gets SIGTERM when the launcher dies (Linux `PR_SET_PDEATHSIG`, set by
`services.launcher.child`), so nothing outlives it. The gateway registers the default
manifests for the checkpoint when it starts; the policy service journals every manifest in
the log directory, so it gets them back when restarted (`respawn`, which `kvrelay up`'s
supervisor calls for a service that died: services.launcher.supervise).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.model.default import DEMO_CHECKPOINT
from services.model.errors import ModelError
from services.model.loader import read_checkpoint
from services.redis_embedded import (
    EmbeddedRedis,
    EmbeddedRedisConfig,
    EmbeddedRedisError,
    free_loopback_port,
)
from services.security.certs import default_bundle
from services.security.roles import Role
from services.security.transport import TransportSecurity

_LOG_TAIL_LINES = 20


class StackError(RuntimeError):
    """A service did not start, or died, or did not stop."""


@dataclass(frozen=True)
class WorkerPorts:
    """A decode worker listens on two ports: gRPC and its TCPStore rendezvous."""

    grpc: int
    rendezvous: int = 0


@dataclass(frozen=True)
class StackConfig:
    """What to run and where. `threads` is each service's torch/OpenMP thread count."""

    checkpoint: Path
    dtype: str | None = None
    host: str = "127.0.0.1"
    gateway_port: int = 50051
    policy_port: int = 50061
    # Replicas 1.. of the policy service (replica 0 on `policy_port`); empty: one service with
    # its own embedded Redis, as before.
    policy_replica_ports: tuple[int, ...] = ()
    # Each policy replica's framed Session listener (`--session-port`), in `policy_ports`'s
    # order: the gateway and the workers make their per-request policy calls (begin, publish,
    # fence, end) there, without gRPC (`--policy-session-address`). Empty: over gRPC.
    policy_session_ports: tuple[int, ...] = ()
    prefill_ports: tuple[int, ...] = (50062,)
    decode_ports: tuple[WorkerPorts, ...] = (WorkerPorts(50063, 50064),)
    redis_url: str | None = None
    log_dir: Path | None = None
    threads: int = 1
    # Until every service is healthy: a real model loads in each worker at once (SmolLM2-135M
    # from GGUF: ~6 s alone on one thread, ~25 s with the stack starting beside it on 2 cores).
    start_timeout_s: float = 300.0
    stop_timeout_s: float = 10.0
    log_level: str = "INFO"
    # Extra `--flag value` pairs per role ("gateway", "prefill", "decode", "policy").
    extra_args: tuple[tuple[str, tuple[str, ...]], ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    # Each service's Prometheus `--metrics-port` from this base: gateway +0, the i-th policy
    # replica +1 + 10 i, the i-th prefill worker +2 + 10 i, the i-th decode worker +3 + 10 i
    # (9091 gives the documented 9091-9094). 0 turns metrics off; None leaves each service its
    # own default.
    metrics_base_port: int | None = None
    # A `kvrelay certs` directory: every service runs with mutual TLS, each with its role's
    # certificate. None: plaintext on loopback, asked for explicitly (`--plaintext`).
    tls_dir: Path | None = None
    # The gateway's OpenAI-compatible HTTP API (`--http-port`); 0: off.
    http_port: int = 0

    def __post_init__(self) -> None:
        if not self.prefill_ports or not self.decode_ports:
            raise ValueError("prefill_ports/decode_ports: a stack needs at least one of each worker")
        if self.policy_session_ports and len(self.policy_session_ports) != len(self.policy_ports):
            raise ValueError(f"policy_session_ports: one per policy replica ({len(self.policy_ports)}), "
                             f"got {len(self.policy_session_ports)}")
        ports = [self.gateway_port, *self.policy_ports, *self.policy_session_ports, *self.prefill_ports,
                 *(p for w in self.decode_ports for p in (w.grpc, w.rendezvous)),
                 *([self.http_port] if self.http_port else [])]
        if any(not 0 < p < 65536 for p in ports):
            raise ValueError(f"ports: every port must be in (0, 65536), got {ports}")
        if len(set(ports)) != len(ports):
            raise ValueError(f"ports: must be distinct, got {ports}")
        if self.threads < 1 or self.start_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise ValueError("threads/start_timeout_s/stop_timeout_s: must be positive")
        if self.policy_replica_ports and not _is_ip_literal(self.host):
            raise ValueError(f"policy_replica_ports: several replicas need an IP address as host, got {self.host!r}")
        if self.metrics_base_port:
            metrics = [self.metrics_port(role, i) for role, count in (("gateway", 1), ("policy", len(self.policy_ports)),
                       ("prefill", len(self.prefill_ports)), ("decode", len(self.decode_ports))) for i in range(count)]
            if max(m or 0 for m in metrics) > 65535 or set(metrics) & set(ports):
                raise ValueError(f"metrics_base_port: {self.metrics_base_port} gives ports out of range or in use")

    @classmethod
    def with_free_ports(
        cls, checkpoint: Path, *, prefill: int = 1, decode: int = 1, policy_replicas: int = 1,
        policy_sessions: bool = True, **overrides: object
    ) -> StackConfig:
        """A config on free loopback ports (tests, demos, benchmarks next to a running stack);
        with `policy_sessions`, the per-request policy calls on framed sessions."""
        _check_replicas(policy_replicas)
        fixed = 2 + prefill + 2 * decode + policy_replicas - 1
        ports = _free_ports(fixed + (policy_replicas if policy_sessions else 0))
        overrides.setdefault("policy_session_ports", tuple(ports[fixed:]))
        return cls(
            checkpoint=checkpoint,
            gateway_port=ports[0],
            policy_port=ports[1],
            prefill_ports=tuple(ports[2 : 2 + prefill]),
            decode_ports=tuple(WorkerPorts(ports[2 + prefill + 2 * i], ports[3 + prefill + 2 * i]) for i in range(decode)),
            policy_replica_ports=tuple(ports[2 + prefill + 2 * decode : fixed]),
            **overrides,  # type: ignore[arg-type]
        )

    @classmethod
    def with_counts(
        cls, checkpoint: Path, *, prefill: int = 1, decode: int = 1, base_port: int = 50051, policy_replicas: int = 1,
        policy_sessions: bool = True, **overrides: object,
    ) -> StackConfig:
        """Ports from `base_port` (the gateway's): its HTTP API +1, policy +10, prefill +11, decode
        +12 and its rendezvous +13, the policy service's framed sessions +14 (with
        `policy_sessions`), the i-th extra worker or policy replica of a role 10 * i higher. The
        default base gives the documented ports 50051 (50052 HTTP), 50061, 50062, 50063/50064,
        50065 (and 50071/50075, 50081/50085, ... for policy replicas 1, 2, ...)."""
        _check_replicas(policy_replicas)
        overrides.setdefault("http_port", base_port + 1)
        if policy_sessions:
            overrides.setdefault("policy_session_ports", tuple(base_port + 14 + 10 * i for i in range(policy_replicas)))
        return cls(
            checkpoint=checkpoint,
            gateway_port=base_port,
            policy_port=base_port + 10,
            policy_replica_ports=tuple(base_port + 10 + 10 * i for i in range(1, policy_replicas)),
            prefill_ports=tuple(base_port + 11 + 10 * i for i in range(prefill)),
            decode_ports=tuple(WorkerPorts(base_port + 12 + 10 * i, base_port + 13 + 10 * i) for i in range(decode)),
            **overrides,  # type: ignore[arg-type]
        )

    @property
    def policy_ports(self) -> tuple[int, ...]:
        """Every policy replica's port, replica 0's (`policy_port`) first."""
        return (self.policy_port, *self.policy_replica_ports)

    @property
    def replicated_policy(self) -> bool:
        """Several policy replicas on one Redis the launcher runs (unless `redis_url`)."""
        return bool(self.policy_replica_ports)

    def address(self, port: int) -> str:
        return f"[{self.host}]:{port}" if ":" in self.host else f"{self.host}:{port}"

    def args_for(self, role: str) -> tuple[str, ...]:
        return next((args for name, args in self.extra_args if name == role), ())

    def metrics_port(self, role: str, index: int = 0) -> int | None:
        """The `--metrics-port` of the `index`-th service of `role` (None: its own default)."""
        if not self.metrics_base_port:
            return self.metrics_base_port
        offset = {"gateway": 0, "policy": 1, "prefill": 2, "decode": 3}[role]
        return self.metrics_base_port + offset + 10 * index


def check_checkpoint(path: Path) -> None:
    """Fail fast, before any process starts, when `path` is not a servable checkpoint: an HF
    directory with config, tokenizer and weights, or a `.gguf` file whose metadata, tokenizer
    and tensor index the runtime accepts (read without dequantizing)."""
    if path.suffix.lower() == ".gguf" and not path.is_dir():
        _check_gguf(path)
        return
    missing = [name for name in ("config.json", "tokenizer.json") if not (path / name).is_file()]
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        hint = " (train it with `kvrelay train-demo`)" if path == DEMO_CHECKPOINT else ""
        raise StackError(f"checkpoint {path} lacks {', '.join(missing)}{hint}")


def _check_gguf(path: Path) -> None:
    try:
        read_checkpoint(path).require_tokenizer()
    except ModelError as error:
        raise StackError(f"checkpoint {path} cannot be served: {error}") from error


def _check_replicas(policy_replicas: int) -> None:
    if policy_replicas < 1:
        raise ValueError(f"policy_replicas: {policy_replicas} must be >= 1")


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_loopback_port()
        if port not in ports:
            ports.append(port)
    return ports


@dataclass
class ServiceProcess:
    """One started service: its gRPC address, process and log file."""

    name: str
    role: str
    address: str
    argv: tuple[str, ...]
    log_path: Path
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    # How the launcher reaches it for health checks (an operator certificate on a TLS stack).
    security: TransportSecurity = field(default_factory=TransportSecurity.local_plaintext, repr=False)
    # Environment of this service alone, over the stack's (a secret such as REDIS_URL, which
    # stays off the command line and so out of the process list).
    env: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def spawn(self, env: dict[str, str]) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**env, **dict(self.env)}, start_new_session=True,
            )

    def check_healthy(self, timeout_s: float = 0.2) -> bool:
        """One gRPC health check: True if the service answers SERVING."""
        with self.security.channel(self.address, Role(self.role)) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            except grpc.RpcError:
                return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def wait_healthy(self, deadline: float) -> None:
        """Poll gRPC health until SERVING; StackError (with the log tail) if the process exits
        or `deadline` (time.monotonic) passes."""
        with self.security.channel(self.address, Role(self.role)) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if not self.running:
                    raise StackError(f"{self.name} exited during start-up:\n{self.log_tail()}")
                with contextlib.suppress(grpc.RpcError):
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                if time.monotonic() >= deadline:
                    raise StackError(f"{self.name} not healthy at {self.address} in time:\n{self.log_tail()}")
                time.sleep(0.1)

    def terminate(self) -> None:
        if self.running:
            assert self.process is not None
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)

    def wait_stopped(self, timeout_s: float) -> None:
        """Wait for exit; after `timeout_s` SIGKILL the whole process group."""
        if self.process is None:
            return
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
        self._kill_group()

    def kill(self) -> None:
        """SIGKILL the service and its process group (for failure tests too)."""
        self._kill_group()
        if self.process is not None:
            self.process.wait(timeout=10)

    def _kill_group(self) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


class RedisProcess(ServiceProcess):
    """The redis-server the policy replicas share (services.redis_embedded), seen as a service:
    healthy while it answers PING, stopped last, restarted by the supervisor on the same port
    with the same password (so the replicas' REDIS_URL stays right)."""

    def __init__(self, redis: EmbeddedRedis, log_path: Path) -> None:
        super().__init__("redis", "redis", "", (), log_path)
        self.redis = redis

    @property
    def pid(self) -> int | None:
        return self.redis.pid

    @property
    def running(self) -> bool:
        return self.redis.running

    @property
    def url(self) -> str:
        """redis:// with the password: for the replicas' environment only."""
        return self.redis.url

    def spawn(self, env: dict[str, str]) -> None:
        """Start redis-server and wait for PING; a failure is logged and leaves it not running
        (the supervisor retries, then gives up), as a service that exits at once does."""
        try:
            self.redis.start()
        except EmbeddedRedisError as error:
            with open(self.log_path, "a") as log:
                log.write(f"kvrelay: {error}\n")
            return
        self.address = f"127.0.0.1:{self.redis.port}"

    def check_healthy(self, timeout_s: float = 0.2) -> bool:
        client = redis.Redis.from_url(self.redis.url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def wait_healthy(self, deadline: float) -> None:
        # `spawn` returns once the server answers PING (within the redis start timeout).
        if not self.running:
            raise StackError(f"{self.name} did not start:\n{self.log_tail()}")

    def terminate(self) -> None:
        """Nothing to do ahead: `wait_stopped` shuts it down (SIGTERM, then SIGKILL)."""

    def wait_stopped(self, timeout_s: float) -> None:
        """Shut it down (the AOF, if any, flushed) and remove its private config: only the
        stack's `stop` calls this, last."""
        self.redis.close()

    def kill(self) -> None:
        self.redis.kill()


def _tier(role: str) -> str:
    return "workers" if role in ("prefill", "decode") else role


def service_command(role: str, *args: str) -> tuple[str, ...]:
    """`kvrelay serve <role> ...` through `services.launcher.child`, which dies with this process."""
    return (sys.executable, "-m", "services.launcher.child", str(os.getpid()), "serve", role, *args)


class Stack:
    """The started services of one `StackConfig`; a context manager that stops them."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="kvrelay-stack-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.services: list[ServiceProcess] = []
        # The redis-server of a replicated policy service without `redis_url` (from `start`).
        self.redis: RedisProcess | None = None

    @property
    def gateway_address(self) -> str:
        return self.config.address(self.config.gateway_port)

    @property
    def http_url(self) -> str | None:
        """Where the gateway's OpenAI-compatible HTTP API listens (None: off)."""
        return f"http://{self.config.address(self.config.http_port)}" if self.config.http_port else None

    @property
    def policy_address(self) -> str:
        """The gateway's and the workers' `--policy-address`: one address, or every replica's
        comma-separated (their policy clients balance it round robin)."""
        return ",".join(self.policy_addresses)

    @property
    def policy_addresses(self) -> list[str]:
        return [self.config.address(port) for port in self.config.policy_ports]

    @property
    def policy_session_address(self) -> str:
        """The gateway's and the workers' `--policy-session-address` (every replica's framed
        Session listener, comma-separated); empty when the stack makes its policy calls over gRPC."""
        return ",".join(self.config.address(port) for port in self.config.policy_session_ports)

    def policy_name(self, index: int) -> str:
        """`policy` for a single policy service, `policy-<index>` for each replica."""
        return f"policy-{index}" if self.config.replicated_policy else "policy"

    @property
    def prefill_addresses(self) -> list[str]:
        return [self.config.address(port) for port in self.config.prefill_ports]

    @property
    def decode_addresses(self) -> list[str]:
        return [self.config.address(ports.grpc) for ports in self.config.decode_ports]

    def service(self, name: str) -> ServiceProcess:
        return next(s for s in self.services if s.name == name)

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self, on_ready: Callable[[ServiceProcess], None] | None = None) -> None:
        """Start every service in dependency order and wait until each is healthy."""
        check_checkpoint(self.config.checkpoint)
        # A new stack starts from a new Redis: manifests of an earlier run (maybe another
        # checkpoint) must not come back; restarts within this run read the journal.
        for index in range(len(self.config.policy_ports)):
            self.manifest_journal_of(index).unlink(missing_ok=True)
        self._ensure_certificates()
        deadline = time.monotonic() + self.config.start_timeout_s
        try:
            if self.config.replicated_policy and not self.config.redis_url:
                self.redis = self._redis()
                self._launch([self.redis], deadline, on_ready)
            self._launch([self._policy(i) for i in range(len(self.config.policy_ports))], deadline, on_ready)
            # The gateway finds workers through health checks, so it starts with them.
            workers = [self._prefill(i, port) for i, port in enumerate(self.config.prefill_ports)]
            workers += [self._decode(i, ports) for i, ports in enumerate(self.config.decode_ports)]
            self._launch([*workers, self._gateway()], deadline, on_ready)
        except BaseException:
            self.stop()
            raise

    def _ensure_certificates(self) -> None:
        """A TLS stack whose directory has no CA yet gets a development set (`kvrelay certs`)."""
        tls = self.config.tls_dir
        if tls is not None and not (tls / "ca.pem").exists():
            default_bundle(tls, hosts=(self.config.host,))

    def stop(self) -> None:
        """Stop the gateway (it drains its requests while the workers still run), then the
        workers together, then the policy service (every replica), then the redis-server the
        replicas share; everything is gone when this returns."""
        for role in ("gateway", "workers", "policy", "redis"):
            tier = [s for s in self.services if _tier(s.role) == role]
            for service in tier:
                service.terminate()
            for service in tier:
                service.wait_stopped(self.config.stop_timeout_s)

    def launch_decode(self, name: str, ports: WorkerPorts, timeout_s: float | None = None) -> ServiceProcess:
        """One more decode worker, outside the gateway's list and owned by the caller (who
        stops it): a spare for failure tests. Returns once it is healthy."""
        return self._launch_spare(self._decode_service(name, ports), timeout_s)

    def launch_prefill(
        self, name: str, port: int, args: Sequence[str] = (), timeout_s: float | None = None
    ) -> ServiceProcess:
        """One more prefill worker, outside the gateway's list and owned by the caller (who
        stops it), with extra flags `args`: a spare for failure tests. Returns once healthy."""
        return self._launch_spare(self._prefill_service(name, port, None, args), timeout_s)

    def _launch_spare(self, service: ServiceProcess, timeout_s: float | None) -> ServiceProcess:
        service.spawn(self._env())
        try:
            service.wait_healthy(time.monotonic() + (timeout_s or self.config.start_timeout_s))
        except BaseException:
            service.kill()
            raise
        return service

    def dead(self) -> list[ServiceProcess]:
        return [s for s in self.services if not s.running]

    def respawn(self, service: ServiceProcess) -> None:
        """Start a service that exited again, with the same flags and ports, after killing
        whatever its old process group left behind."""
        service.kill()
        service.spawn(self._env())

    def _launch(self, services: Sequence[ServiceProcess], deadline: float,
                on_ready: Callable[[ServiceProcess], None] | None) -> None:
        env = self._env()
        for service in services:
            self.services.append(service)
            service.spawn(env)
        for service in services:
            service.wait_healthy(deadline)
            if on_ready is not None:
                on_ready(service)

    def _env(self) -> dict[str, str]:
        threads = str(self.config.threads)
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
               "KVRELAY_TORCH_THREADS": threads, "KVRELAY_LOG_LEVEL": self.config.log_level,
               "PYTHONUNBUFFERED": "1"}
        env.pop("REDIS_URL", None)
        if self.config.redis_url:
            env["REDIS_URL"] = self.config.redis_url
        env.update(dict(self.config.env))
        return env

    def _service(self, name: str, role: str, port: int, args: Sequence[str], index: int | None = 0,
                 extra: Sequence[str] = ()) -> ServiceProcess:
        argv = service_command(role, *args, *self._metrics_args(role, index), *self._security_args(role),
                               *self.config.args_for(role), *extra)
        return ServiceProcess(name, role, self.config.address(port), argv, self.log_dir / f"{name}.log",
                              security=self.client_security("operator"))

    def _security_args(self, role: str) -> list[str]:
        tls = self.config.tls_dir
        if tls is None:
            return ["--plaintext"]
        return ["--tls-cert", str(tls / f"{role}.pem"), "--tls-key", str(tls / f"{role}.key"),
                "--tls-ca", str(tls / "ca.pem")]

    def client_security(self, identity: str) -> TransportSecurity:
        """How a client holding `identity`'s certificate (of the stack's TLS directory) reaches
        the stack's services; plaintext on a plaintext stack."""
        tls = self.config.tls_dir
        if tls is None:
            return TransportSecurity.local_plaintext()
        return TransportSecurity.from_files(cert=tls / f"{identity}.pem", key=tls / f"{identity}.key",
                                            ca=tls / "ca.pem")

    def _metrics_args(self, role: str, index: int | None) -> list[str]:
        """`--metrics-port` when the stack numbers metrics ports; a spare (`index` None) gets 0 (off)."""
        if self.config.metrics_base_port is None:
            return []
        port = 0 if index is None else self.config.metrics_port(role, index)
        return ["--metrics-port", str(port)]

    def _policy_session_args(self) -> list[str]:
        address = self.policy_session_address
        return ["--policy-session-address", address] if address else []

    def _model_args(self) -> list[str]:
        args = ["--checkpoint", str(self.config.checkpoint)]
        return args + (["--dtype", self.config.dtype] if self.config.dtype else [])

    @property
    def manifest_journal(self) -> Path:
        """Where the policy service keeps the manifests it stored (read back on a restart)."""
        return self.manifest_journal_of(0)

    def manifest_journal_of(self, index: int) -> Path:
        """Policy replica `index`'s journal: one file per process, so no two append to one."""
        return self.log_dir / f"{self.policy_name(index)}-manifests.jsonl"

    def _policy(self, index: int = 0) -> ServiceProcess:
        port = self.config.policy_ports[index]
        # The checkpoint too: the policy service refuses manifests the workers cannot run.
        args = [*self._model_args(), "--host", self.config.host, "--port", str(port),
                "--manifest-journal", str(self.manifest_journal_of(index)),
                "--session-port", str(self.config.policy_session_ports[index] if self.config.policy_session_ports else 0)]
        service = self._service(self.policy_name(index), "policy", port, args, index)
        if self.redis is not None:
            # Not `--redis-url` on the command line: the URL holds the password.
            service.env = (("REDIS_URL", self.redis.url),)
        return service

    def _redis(self) -> RedisProcess:
        """The replicas' redis-server, with the persistence a single policy service's embedded
        one would get from the same environment (`KVRELAY_REDIS_DATA_DIR`: AOF there)."""
        env = self._env()
        data_dir = env.get("KVRELAY_REDIS_DATA_DIR")
        log_path = self.log_dir / "redis.log"
        config = EmbeddedRedisConfig(
            data_dir=Path(data_dir) if data_dir else None,
            appendfsync=env.get("KVRELAY_REDIS_APPENDFSYNC", "everysec"),
            stop_timeout_s=self.config.stop_timeout_s,
            # Its log beside the services' (a later `logfile` line wins over the default).
            extra_config=(f'logfile "{log_path}"',),
            own_session=True,  # Ctrl-C reaches only the launcher, which stops Redis last
        )
        return RedisProcess(EmbeddedRedis(config), log_path)

    def _prefill(self, index: int, port: int) -> ServiceProcess:
        return self._prefill_service(f"prefill-{index}", port, index)

    def _prefill_service(self, name: str, port: int, index: int | None = None, extra: Sequence[str] = ()) -> ServiceProcess:
        args = [*self._model_args(), "--host", self.config.host, "--port", str(port),
                "--policy-address", self.policy_address, *self._policy_session_args(), "--worker-id", name]
        return self._service(name, "prefill", port, args, index, extra)

    def _decode(self, index: int, ports: WorkerPorts) -> ServiceProcess:
        return self._decode_service(f"decode-{index}", ports, index)

    def _decode_service(self, name: str, ports: WorkerPorts, index: int | None = None) -> ServiceProcess:
        args = [*self._model_args(), "--host", self.config.host, "--port", str(ports.grpc),
                "--transfer-port", str(ports.rendezvous), "--policy-address", self.policy_address,
                *self._policy_session_args(),
                "--worker-id", name]
        return self._service(name, "decode", ports.grpc, args, index)

    def _gateway(self) -> ServiceProcess:
        args = [*self._model_args(), "--host", self.config.host, "--port", str(self.config.gateway_port),
                "--policy-address", self.policy_address, *self._policy_session_args(),
                "--prefill-workers", ",".join(self.prefill_addresses),
                "--decode-workers", ",".join(self.decode_addresses)]
        if self.config.http_port:
            args += ["--http-port", str(self.config.http_port)]
        return self._service("gateway", "gateway", self.config.gateway_port, args)

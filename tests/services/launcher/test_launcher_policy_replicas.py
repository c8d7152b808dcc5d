"""`kvrelay up --policy-replicas N` (issue 21): the port layout, the flags every service gets,
and the redis-server the replicas share as a supervised service (a real redis-server). The
whole stack riding through a killed replica is tests/e2e/test_e2e_policy_replicas.py."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from services.launcher.stack import RedisProcess, ServiceProcess, Stack, StackConfig
from services.launcher.supervise import RestartPolicy, Supervisor

SLEEPER = (sys.executable, "-c", "import time; time.sleep(120)")


def flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_replicas_take_the_policy_port_and_every_tenth_above_it_and_one_keeps_the_old_layout() -> None:
    single = StackConfig.with_counts(Path("ckpt"), prefill=2, decode=2, metrics_base_port=9091)
    assert (single.policy_port, single.policy_ports, single.replicated_policy) == (50061, (50061,), False)
    config = StackConfig.with_counts(Path("ckpt"), prefill=2, decode=2, policy_replicas=3, metrics_base_port=9091)
    assert config.policy_ports == (50061, 50071, 50081) and config.replicated_policy
    # Everything else where a single policy service leaves it.
    assert (config.prefill_ports, config.decode_ports) == (single.prefill_ports, single.decode_ports)
    assert [config.metrics_port("policy", i) for i in range(3)] == [9092, 9102, 9112]
    assert [config.metrics_port(r, i) for r in ("gateway", "prefill", "decode") for i in range(2)
            if (r, i) != ("gateway", 1)] == [9091, 9093, 9103, 9094, 9104]
    free = StackConfig.with_free_ports(Path("ckpt"), decode=2, policy_replicas=2)
    ports = [free.gateway_port, *free.policy_ports, *free.prefill_ports,
             *(p for w in free.decode_ports for p in (w.grpc, w.rendezvous))]
    assert len(free.policy_ports) == 2 and len(set(ports)) == len(ports) == 8


@pytest.mark.parametrize(("overrides", "field"), [
    ({"policy_replicas": 0}, "policy_replicas"),
    ({"policy_replicas": 2, "host": "localhost"}, "policy_replica_ports"),  # no ipv4: list for names
    ({"policy_replicas": 2, "metrics_base_port": 50040}, "metrics_base_port"),  # replica 1: 50051
])
def test_bad_replica_configs_name_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        StackConfig.with_counts(Path("ckpt"), **overrides)  # type: ignore[arg-type]


def test_every_client_gets_every_replica_and_each_replica_its_own_ports_journal_and_redis(tmp_path: Path) -> None:
    stack = Stack(StackConfig.with_counts(Path("/ckpt"), policy_replicas=2, log_dir=tmp_path, metrics_base_port=9091))
    both = "127.0.0.1:50061,127.0.0.1:50071"
    assert stack.policy_address == both
    for service in (stack._gateway(), stack._prefill(0, 50062), stack._decode(0, stack.config.decode_ports[0])):
        assert flag(service.argv, "--policy-address") == both, service.name
    stack.redis = stack._redis()
    try:
        replicas = [stack._policy(i) for i in range(2)]
        assert [r.name for r in replicas] == ["policy-0", "policy-1"]
        assert [flag(r.argv, "--port") for r in replicas] == ["50061", "50071"]
        assert [flag(r.argv, "--metrics-port") for r in replicas] == ["9092", "9102"]
        assert [flag(r.argv, "--manifest-journal") for r in replicas] == [
            str(tmp_path / "policy-0-manifests.jsonl"), str(tmp_path / "policy-1-manifests.jsonl")]
        # The shared Redis through the environment: its URL holds the password.
        assert all(dict(r.env) == {"REDIS_URL": stack.redis.url} for r in replicas)
        assert not any("--redis-url" in r.argv or stack.redis.url in r.argv for r in replicas)
    finally:
        stack.redis.wait_stopped(1.0)  # never started; removes its private directory
    single = Stack(StackConfig.with_counts(Path("/ckpt"), log_dir=tmp_path))._policy()
    assert (single.name, single.env, flag(single.argv, "--manifest-journal")) == (
        "policy", (), str(tmp_path / "policy-manifests.jsonl"))


@pytest.fixture
def replicated(tmp_path: Path) -> Iterator[Stack]:
    """A replicated stack's processes: its real redis-server and stand-ins (sleeping processes)
    for two policy replicas, one worker of each kind and the gateway."""
    stack = Stack(StackConfig.with_free_ports(tmp_path, policy_replicas=2, log_dir=tmp_path))
    stack.redis = stack._redis()
    stack.redis.spawn({})
    stack.services.append(stack.redis)
    for name, role in (("policy-0", "policy"), ("policy-1", "policy"), ("prefill-0", "prefill"),
                       ("decode-0", "decode"), ("gateway", "gateway")):
        service = ServiceProcess(name, role, "127.0.0.1:1", SLEEPER, tmp_path / f"{name}.log")
        service.spawn({})
        stack.services.append(service)
    try:
        yield stack
    finally:
        stack.stop()


def test_a_killed_redis_is_restarted_on_its_port_with_its_password(replicated: Stack) -> None:
    redis_process = replicated.redis
    assert isinstance(redis_process, RedisProcess) and redis_process.check_healthy(1.0)
    client = redis.Redis.from_url(redis_process.url, socket_timeout=2)
    try:
        client.set("k", "v")
        now = [0.0]
        supervisor = Supervisor(replicated, RestartPolicy(initial_s=1.0), clock=lambda: now[0])
        first_pid, address = redis_process.pid, redis_process.address
        redis_process.kill()
        assert not redis_process.check_healthy()
        assert [(e.kind, e.service.name) for e in supervisor.poll()] == [("exited", "redis"), ("restarting", "redis")]
        now[0] = 1.0
        assert [e.kind for e in supervisor.poll()] == ["restarted"]
        assert [e.kind for e in supervisor.poll()] == ["ready"]
        assert redis_process.pid != first_pid and redis_process.address == address
        assert client.ping() and client.get("k") is None  # in memory by default: the journals restore
    finally:
        client.close()
    assert "Ready to accept connections" in (replicated.log_dir / "redis.log").read_text()


def test_the_stack_needs_its_redis_and_one_policy_replica(replicated: Stack) -> None:
    supervisor = Supervisor(replicated, RestartPolicy(max_restarts=0))
    replicated.service("policy-0").kill()
    assert [e.kind for e in supervisor.poll()] == ["exited", "given_up"]
    assert supervisor.broken() == []  # policy-1 still serves
    replicated.service("policy-1").kill()
    supervisor.poll()
    assert supervisor.broken() == ["every policy replica is down"]
    assert replicated.redis is not None
    replicated.redis.kill()
    supervisor.poll()
    assert supervisor.broken() == ["redis is down", "every policy replica is down"]


def test_stop_ends_the_gateway_then_workers_then_replicas_then_redis(replicated: Stack) -> None:
    order: list[str] = []
    for service in replicated.services:
        def wait_stopped(timeout_s: float, service: ServiceProcess = service,
                         original: object = service.wait_stopped) -> None:
            order.append(service.name)
            assert callable(original)
            original(timeout_s)
        service.wait_stopped = wait_stopped  # type: ignore[method-assign]
    redis_pid = replicated.redis.pid if replicated.redis else None
    replicated.stop()
    assert order == ["gateway", "prefill-0", "decode-0", "policy-0", "policy-1", "redis"]
    assert redis_pid is not None and not any(s.running for s in replicated.services)

"""The local stack's configuration and commands (the processes themselves run in tests/e2e)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.launcher.stack import (
    DEMO_CHECKPOINT,
    Stack,
    StackConfig,
    StackError,
    WorkerPorts,
    service_command,
)


def test_default_ports_are_the_documented_ones() -> None:
    config = StackConfig.with_counts(Path("ckpt"), prefill=2, decode=2)
    assert (config.gateway_port, config.policy_port) == (50051, 50061)
    assert config.prefill_ports == (50062, 50072)
    assert config.decode_ports == (WorkerPorts(50063, 50064), WorkerPorts(50073, 50074))
    shifted = StackConfig.with_counts(Path("ckpt"), base_port=41000)
    assert (shifted.gateway_port, shifted.policy_port, shifted.prefill_ports) == (41000, 41010, (41011,))
    assert (config.http_port, shifted.http_port) == (50052, 41001)  # the gateway's HTTP API
    assert StackConfig.with_free_ports(Path("ckpt")).http_port == 0  # off unless asked for
    # The policy service's framed sessions: +14, and 10 higher for each replica.
    assert config.policy_session_ports == (50065,) and shifted.policy_session_ports == (41014,)
    replicated = StackConfig.with_counts(Path("ckpt"), policy_replicas=3)
    assert replicated.policy_ports == (50061, 50071, 50081)
    assert replicated.policy_session_ports == (50065, 50075, 50085)
    assert StackConfig.with_counts(Path("ckpt"), policy_sessions=False).policy_session_ports == ()


def test_free_ports_are_distinct() -> None:
    config = StackConfig.with_free_ports(Path("ckpt"), prefill=2, decode=3, policy_replicas=2)
    ports = [config.gateway_port, *config.policy_ports, *config.policy_session_ports, *config.prefill_ports,
             *(p for w in config.decode_ports for p in (w.grpc, w.rendezvous))]
    assert len(set(ports)) == len(ports) == 13
    assert StackConfig.with_free_ports(Path("ckpt"), policy_sessions=False).policy_session_ports == ()


@pytest.mark.parametrize("overrides", [
    {"prefill_ports": ()},
    {"decode_ports": (WorkerPorts(50061, 50064),)},  # collides with the policy port
    {"gateway_port": 0},
    {"threads": 0},
    {"policy_session_ports": (50065, 50075)},  # two listeners for one policy service
    {"policy_session_ports": (50062,)},  # the prefill worker's port
])
def test_invalid_configs_name_the_field(overrides: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="ports|threads"):
        StackConfig(checkpoint=Path("ckpt"), **overrides)  # type: ignore[arg-type]


def test_services_are_launched_with_consistent_flags(tmp_path: Path) -> None:
    config = StackConfig.with_counts(Path("/ckpt"), prefill=1, decode=2, dtype="bfloat16", log_dir=tmp_path,
                                     extra_args=(("gateway", ("--max-retries", "0")),))
    stack = Stack(config)
    gateway = stack._gateway()
    argv = list(gateway.argv)
    assert argv[argv.index("--prefill-workers") + 1] == "127.0.0.1:50062"
    assert argv[argv.index("--decode-workers") + 1] == "127.0.0.1:50063,127.0.0.1:50073"
    assert argv[-2:] == ["--max-retries", "0"] and "--dtype" in argv
    assert argv[argv.index("--http-port") + 1] == "50052"
    decode = list(stack._decode(1, config.decode_ports[1]).argv)
    assert decode[decode.index("--transfer-port") + 1] == "50074"
    assert decode[decode.index("--policy-address") + 1] == "127.0.0.1:50061"
    assert gateway.log_path == tmp_path / "gateway.log"
    # Every policy client makes its per-request calls on the framed sessions the policy serves.
    policy = list(stack._policy().argv)
    assert policy[policy.index("--session-port") + 1] == "50065"
    for argv in (gateway.argv, decode, stack._prefill(0, 50062).argv):
        assert argv[list(argv).index("--policy-session-address") + 1] == "127.0.0.1:50065"
    over_grpc = Stack(StackConfig.with_counts(Path("/ckpt"), policy_sessions=False, log_dir=tmp_path))
    policy = list(over_grpc._policy().argv)
    assert policy[policy.index("--session-port") + 1] == "0"
    assert "--policy-session-address" not in over_grpc._gateway().argv


def test_demo_checkpoint_path_matches_the_model_runtime() -> None:
    from services.model.default import DEMO_CHECKPOINT as RUNTIME_DEMO_CHECKPOINT

    assert DEMO_CHECKPOINT == RUNTIME_DEMO_CHECKPOINT


def test_an_incomplete_checkpoint_fails_before_any_process_starts(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    stack = Stack(StackConfig.with_free_ports(tmp_path, log_dir=tmp_path / "logs"))
    with pytest.raises(StackError, match=r"lacks tokenizer\.json, \*\.safetensors"):
        stack.start()
    assert stack.services == []


def test_services_run_through_the_child_entry_point_that_dies_with_the_launcher() -> None:
    import os

    argv = service_command("decode", "--port", "1")
    assert argv[1:6] == ("-m", "services.launcher.child", str(os.getpid()), "serve", "decode")


def test_a_child_whose_launcher_is_gone_does_not_start() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "services.launcher.child", "1", "serve", "policy"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "launcher 1 is gone" in done.stderr


def test_metrics_ports_are_numbered_per_service_or_left_to_the_services(tmp_path: Path) -> None:
    def metrics_port(argv: tuple[str, ...]) -> str | None:
        return argv[argv.index("--metrics-port") + 1] if "--metrics-port" in argv else None

    config = StackConfig.with_counts(Path("/ckpt"), prefill=2, decode=2, log_dir=tmp_path, metrics_base_port=9091)
    stack = Stack(config)
    ports = [metrics_port(s.argv) for s in (stack._gateway(), stack._policy(), stack._prefill(0, 50062),
                                            stack._prefill(1, 50072), stack._decode(0, config.decode_ports[0]),
                                            stack._decode(1, config.decode_ports[1]))]
    assert ports == ["9091", "9092", "9093", "9103", "9094", "9104"]
    assert metrics_port(stack._decode_service("spare", WorkerPorts(50083, 50084)).argv) == "0"
    assert metrics_port(Stack(StackConfig.with_counts(Path("/ckpt"), log_dir=tmp_path))._gateway().argv) is None
    with pytest.raises(ValueError, match="metrics_base_port"):
        StackConfig.with_counts(Path("/ckpt"), metrics_base_port=50060)  # lands on the gRPC ports 50061-50063


def test_commands_without_a_checkpoint_serve_the_default_model() -> None:
    from kvrelay.cli import served_checkpoint
    from services.model.default import default_checkpoint

    assert served_checkpoint(None) == default_checkpoint()
    assert served_checkpoint(Path("/elsewhere")) == Path("/elsewhere")


def test_the_default_gguf_passes_the_start_up_check_and_a_truncated_one_fails_first(tmp_path: Path) -> None:
    from services.launcher.stack import check_checkpoint
    from services.model.default import default_checkpoint

    check_checkpoint(default_checkpoint())
    truncated = tmp_path / "truncated.gguf"
    with open(default_checkpoint(), "rb") as source:
        truncated.write_bytes(source.read(4096))
    stack = Stack(StackConfig.with_free_ports(truncated, log_dir=tmp_path / "logs"))
    with pytest.raises(StackError, match="truncated.gguf cannot be served"):
        stack.start()
    assert stack.services == []

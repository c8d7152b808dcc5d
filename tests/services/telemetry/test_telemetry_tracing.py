"""Tracing configuration from the standard OTEL_* variables, and what a process gets: with
tracing off no SDK provider, exporter or gRPC patch is installed (a fresh interpreter each,
since an installed provider is process-global)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.telemetry.tracing import TracingConfig, traced_method, tracing_config

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("environ", "exporters"),
    [
        ({}, ()),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317"}, ("otlp",)),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://jaeger:4317"}, ("otlp",)),
        ({"OTEL_TRACES_EXPORTER": "console"}, ("console",)),
        ({"OTEL_TRACES_EXPORTER": "otlp, console,otlp"}, ("otlp", "console")),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317"}, ()),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, ()),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, ("otlp",)),
    ],
)
def test_exporters_follow_the_standard_variables(environ: dict[str, str], exporters: tuple[str, ...]) -> None:
    config = tracing_config("kvrelay-decode", environ)
    assert config.exporters == exporters
    assert config.enabled == bool(exporters)


def test_service_name_defaults_to_the_role_and_otel_service_name_overrides() -> None:
    assert tracing_config("kvrelay-decode", {}).service_name == "kvrelay-decode"
    assert tracing_config("kvrelay-decode", {"OTEL_SERVICE_NAME": "decode-a"}).service_name == "decode-a"


@pytest.mark.parametrize(
    ("environ", "variable"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"},
         "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
    ],
)
def test_unsupported_settings_are_rejected_naming_the_variable(environ: dict[str, str], variable: str) -> None:
    with pytest.raises(ValueError, match=variable):
        tracing_config("kvrelay-gateway", environ)
    with pytest.raises(ValueError, match="service_name"):
        TracingConfig("")


def test_probes_and_tooling_are_not_traced() -> None:
    assert traced_method("/kvrelay.v1.PolicyService/PublishState")
    assert not traced_method("/grpc.health.v1.Health/Check")
    assert not traced_method("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")


_PROBE = """
import json, sys
import grpc
original = grpc.aio.insecure_channel
from opentelemetry import trace
from services.telemetry.tracing import configure_tracing, server_interceptors
tracing = configure_tracing("kvrelay-policy")
state = {
    "enabled": tracing.enabled,
    "provider": type(trace.get_tracer_provider()).__module__,
    "sdk_loaded": "opentelemetry.sdk.trace" in sys.modules,
    "exporter_loaded": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter" in sys.modules,
    "channels_patched": grpc.aio.insecure_channel is not original,
    "server_interceptors": len(server_interceptors()),
}
tracing.shutdown()
state["restored"] = grpc.aio.insecure_channel is original and not server_interceptors()
print(json.dumps(state))
"""


def _probe(environ: dict[str, str]) -> dict[str, object]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", _PROBE], env={**clean, **environ}, capture_output=True,
                          text=True, timeout=90, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_tracing_off_installs_no_sdk_provider_exporter_or_grpc_patch() -> None:
    state = _probe({})
    assert state == {"enabled": False, "provider": "opentelemetry.trace", "sdk_loaded": False,
                     "exporter_loaded": False, "channels_patched": False, "server_interceptors": 0,
                     "restored": True}


def test_tracing_on_installs_the_sdk_provider_exporter_and_interceptors() -> None:
    # A closed loopback port: shutdown's final export fails fast and is only logged.
    state = _probe({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_EXPORTER_OTLP_TIMEOUT": "1"})
    assert state == {"enabled": True, "provider": "opentelemetry.sdk.trace", "sdk_loaded": True,
                     "exporter_loaded": True, "channels_patched": True, "server_interceptors": 1,
                     "restored": True}

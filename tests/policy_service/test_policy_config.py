"""PolicyServiceConfig validation and password redaction."""

from __future__ import annotations

import pytest

from policy_service.config import PolicyServiceConfig, redact_url
from services.rpc.server import ServerConfig


def test_passwords_never_reach_logs() -> None:
    assert redact_url("redis://kvr:s3cret@redis.svc:6379/0") == "redis://kvr:***@redis.svc:6379/0"
    assert redact_url("rediss://:s3cret@[::1]:6380/0?ssl_ca_certs=/ca.pem") == "rediss://:***@[::1]:6380/0?ssl_ca_certs=/ca.pem"
    assert redact_url("redis://127.0.0.1:6379") == "redis://127.0.0.1:6379"


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"redis_url": "http://x"}, "redis_url"),
        ({"redis_appendfsync": "never"}, "redis_appendfsync"),
        ({"key_prefix": ""}, "key_prefix"),
        ({"default_lease_ms": 0}, "default_lease_ms"),
        ({"end_retention_ms": -1}, "end_retention_ms"),
        ({"max_manifest_bytes": 16 * 1024 * 1024}, "max_manifest_bytes"),
        ({"server": ServerConfig(max_message_bytes=1024)}, "max_manifest_bytes"),
        ({"redis_retries": -1}, "redis_retries"),
        ({"redis_backoff_base_s": 1.0, "redis_backoff_cap_s": 0.1}, "redis_backoff_base_s"),
    ],
)
def test_bad_values_name_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        PolicyServiceConfig(**changes)  # type: ignore[arg-type]


def test_defaults_use_an_embedded_redis() -> None:
    config = PolicyServiceConfig()
    assert config.redis_url is None and config.server.port == 50061
    assert PolicyServiceConfig(redis_url="rediss://u:p@h:1/0").redis_url == "rediss://u:p@h:1/0"

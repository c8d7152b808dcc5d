"""Losing Redis under the shared `kvrelay up` stack (issue 15, item 5): the policy service's
embedded redis-server SIGKILLed, then the policy service itself SIGKILLed. Either way Redis
comes back empty; the manifests must come back too (from the policy service's memory, then
from its journal) and Generate must succeed again within 10 s, without restarting anything
by hand; a SIGKILLed policy service leaves no redis-server behind."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from e2e_helpers import UpStack, alive, wait_every_service_serving, wait_gone

from services.gateway.client import GatewayClient, generate_request
from services.kvpolicy.manifest import default_manifests
from services.model import LoadedModel
from services.policy import PolicyClient, PolicyClientConfig

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]
RECOVERY_TARGET_S = 10.0


def redis_children(pid: int) -> list[int]:
    """The redis-server processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(stat[1]) == pid and b"redis-server" in command:
            found.append(int(entry.name))
    return found


def until_served(stack: UpStack, started: float, timeout_s: float = 30.0) -> tuple[float, list[str]]:
    """Seconds from `started` until a default-policy Generate succeeds, and the errors before."""
    errors: list[str] = []
    with GatewayClient(stack.gateway_address, timeout_s=20) as client:
        while time.monotonic() - started < timeout_s:
            try:
                client.generate(generate_request("the quiet river crosses the old bridge", max_tokens=2))
                return time.monotonic() - started, errors
            except grpc.RpcError as exc:
                errors.append(f"{exc.code().name}: {(exc.details() or '')[:300]}")
            time.sleep(0.1)
    raise AssertionError(f"no Generate succeeded within {timeout_s} s: {errors[-3:]}")


def registered(policy_address: str) -> set[str]:
    async def names() -> set[str]:
        async with PolicyClient(PolicyClientConfig(policy_address, timeout_s=5.0)) as client:
            return {ref.name for ref in await client.list_manifests()}

    return asyncio.run(names())


def test_a_killed_embedded_redis_is_restarted_and_refilled(stack: UpStack) -> None:
    policy = stack.pids["policy"]
    (old,) = redis_children(policy)
    before = registered(stack.policy_address)
    until_served(stack, time.monotonic())

    killed = time.monotonic()
    os.kill(old, signal.SIGKILL)
    recovered_s, errors = until_served(stack, killed)
    print(f"redis-server SIGKILLed: Generate succeeds again after {recovered_s:.2f} s; failed before: {errors}")
    assert recovered_s < RECOVERY_TARGET_S
    assert alive(policy) and redis_children(policy) not in ([], [old])
    assert registered(stack.policy_address) == before
    print(f"every service SERVING again {wait_every_service_serving(stack, RECOVERY_TARGET_S):.2f} s later")


def test_a_sigkilled_policy_service_is_restarted_with_its_manifests(stack: UpStack, loaded: LoadedModel) -> None:
    custom = replace(default_manifests(loaded.tensor_contract, budget_fraction=0.5)["snapkv"],
                     name="loss-snapkv", policy_manifest_id="loss-snapkv@1")

    async def register() -> None:
        async with PolicyClient(PolicyClientConfig(stack.policy_address, timeout_s=5.0)) as client:
            await client.register_manifest(custom.canonical_json())

    asyncio.run(register())
    before = registered(stack.policy_address)
    assert "loss-snapkv" in before
    policy = stack.pids["policy"]
    (embedded,) = redis_children(policy)

    killed = time.monotonic()
    os.kill(policy, signal.SIGKILL)
    assert wait_gone([embedded], 5) == [], "the embedded redis-server outlived its policy service"
    match = stack.output.wait_for(rf"ready policy\s+\S+\s+pid (?!{policy}\b)(\d+)", 60)
    stack.pids["policy"] = int(match.group(1))  # the session's teardown checks every service
    recovered_s, errors = until_served(stack, killed)
    print(f"policy service SIGKILLed: restarted, Generate succeeds again after {recovered_s:.2f} s; "
          f"failed before: {errors}")
    assert recovered_s < RECOVERY_TARGET_S
    assert registered(stack.policy_address) == before
    assert re.search(r"restarted policy \(restart 1\)", stack.output.text)
    print(f"every service SERVING again {wait_every_service_serving(stack, RECOVERY_TARGET_S):.2f} s later")

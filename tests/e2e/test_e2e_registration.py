"""Registration through the real stack cannot break a policy for everyone (issue 15, items 2-4,
11, 12, 14): out-of-range integers and manifests the workers cannot run are refused before
anything is stored, a huge manifest is refused in milliseconds without growing the policy
service or delaying other calls, long or undecodable inputs are INVALID_ARGUMENT naming what
failed, and every policy keeps serving. Nothing here is stored, so the shared stack is as it was."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from e2e_helpers import KVRELAY, UpStack, needle_ids

from services.gateway.client import GatewayClient, generate_request
from services.kvpolicy.manifest import KVVisibilityPolicyManifest
from services.model import LoadedModel
from services.policy import ManifestDoesNotFit, ManifestInvalid, PolicyClient, PolicyClientConfig
from services.rpc.errors import error_detail
from services.rpc.kvrelay.v1 import gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.timeout(180)


def rss_mb(pid: int) -> float:
    line = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


async def snapkv_of(client: PolicyClient) -> KVVisibilityPolicyManifest:
    (ref,) = await client.list_manifests("snapkv")
    return KVVisibilityPolicyManifest.from_json((await client.get_manifest(ref.sha256)).canonical_json)


def generated(stack: UpStack, loaded: LoadedModel, policy: str | None) -> float:
    """Seconds to generate two tokens under `policy` (None: the gateway's default)."""
    started = time.perf_counter()
    with GatewayClient(stack.gateway_address, timeout_s=60) as client:
        result = client.generate(generate_request(needle_ids(loaded, 48, 3), policy=policy, max_tokens=2))
    assert result.summary.output_tokens >= 1
    return time.perf_counter() - started


def test_register_of_a_missing_file_is_one_line_and_exit_2() -> None:
    done = subprocess.run([*KVRELAY, "policies", "--register", "/nonexistent/manifest.json"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert done.stderr.strip() == "kvrelay policies: --register /nonexistent/manifest.json: no such file"
    assert "Traceback" not in done.stdout + done.stderr


async def refuse_bad_registrations(stack: UpStack) -> None:
    async with PolicyClient(PolicyClientConfig(stack.policy_address, timeout_s=10.0)) as client:
        snapkv = await snapkv_of(client)
        data = snapkv.to_dict()
        with pytest.raises(ManifestInvalid) as caught:
            await client.register_manifest(json.dumps({**data, "policy_generation": 2**63}))
        assert caught.value.field == "policy_generation"
        digits = json.dumps({**data, "policy_generation": 7}).replace(
            '"policy_generation": 7', f'"policy_generation": {"9" * 5000}')
        with pytest.raises(ManifestInvalid) as caught:
            await client.register_manifest(digits)
        assert caught.value.field == "policy_generation"
        # Generation 2 for another head_dim: the policy service knows the checkpoint (the
        # launcher passes it) and refuses what the workers cannot run.
        unfit = {**data, "policy_generation": 2, "policy_manifest_id": "snapkv@2",
                 "tensor": {**data["tensor"], "head_dim": 2 * snapkv.tensor.head_dim}}
        with pytest.raises(ManifestDoesNotFit) as refused:
            await client.register_manifest(json.dumps(unfit))
        assert refused.value.field == "tensor.head_dim"
        assert [r.policy_generation for r in await client.list_manifests("snapkv")] == [1]


def test_bad_registrations_are_refused_and_every_policy_keeps_serving(stack: UpStack, loaded: LoadedModel) -> None:
    asyncio.run(refuse_bad_registrations(stack))
    listed = subprocess.run([*KVRELAY, "policies", "--policy-address", stack.policy_address],
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and "snapkv" in listed.stdout, listed
    with grpc.insecure_channel(stack.gateway_address) as channel, pytest.raises(grpc.RpcError) as caught:
        list(gateway_pb2_grpc.GatewayStub(channel).Generate(generate_request([1, 5], policy="no-such"), timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for policy in ("snapkv", None, "full"):
        generated(stack, loaded, policy)
    assert not stack.dead()


async def huge_manifest_storm(stack: UpStack) -> tuple[list[float], list[float]]:
    """Five registrations of issue 15's manifest, each timed, with ListManifests running beside."""
    async with PolicyClient(PolicyClientConfig(stack.policy_address, timeout_s=10.0)) as client:
        data = (await snapkv_of(client)).to_dict()
        heads = data["tensor"]["num_q_heads"]
        data["tensor"] |= {"num_kv_heads": 10**7, "gqa_grouping": "custom", "q_to_kv_head_map": list(range(heads))}
        payload = json.dumps(data)
        listing: list[float] = []

        async def list_meanwhile() -> None:
            for _ in range(10):
                started = time.perf_counter()
                await client.list_manifests()
                listing.append(time.perf_counter() - started)

        lister = asyncio.create_task(list_meanwhile())
        refusals = []
        for _ in range(5):
            started = time.perf_counter()
            with pytest.raises(ManifestInvalid) as caught:
                await client.register_manifest(payload)
            refusals.append(time.perf_counter() - started)
            assert caught.value.field == "tensor.num_kv_heads" and len(str(caught.value)) < 300
        await asyncio.wait_for(lister, 30)
    return refusals, listing


def test_a_huge_manifest_is_refused_fast_and_delays_nobody(stack: UpStack, loaded: LoadedModel) -> None:
    """Issue 15: 4.1 s of a blocked policy service, 76 MB -> 1.18 GB, a concurrent Generate 3.97 s."""
    policy_pid = stack.pids["policy"]
    baseline_s = min(generated(stack, loaded, "snapkv") for _ in range(2))
    rss_before = rss_mb(policy_pid)
    with ThreadPoolExecutor(1) as pool:
        during = pool.submit(generated, stack, loaded, "snapkv")
        refusals, listing = asyncio.run(huge_manifest_storm(stack))
        during_s = during.result(timeout=120)
    assert max(refusals) < 1.0, refusals
    assert max(listing) < 2.0, listing
    assert rss_mb(policy_pid) - rss_before < 50
    assert during_s < baseline_s + 1.0, (during_s, baseline_s)


def bad_bytes_cases() -> list[tuple[bytes, str]]:
    text = gateway_pb2.GenerateRequest(text="QQQQ").SerializeToString().replace(b"QQQQ", b"\xff\xfe\xff\xfe")
    return [(text, "text"), (b"\x0a\xff\xff", "request")]


def test_long_names_and_undecodable_requests_are_invalid_argument(stack: UpStack) -> None:
    with grpc.insecure_channel(stack.gateway_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for request, field in ((generate_request([1, 5], policy="p" * 10_000), "manifest.by_name.name"),
                               (generate_request([1, 5], manifest_sha256="f" * 10_000), "manifest.sha256")):
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(request, timeout=30))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
            detail = error_detail(caught.value)  # type: ignore[arg-type]
            assert detail is not None and detail.field == field and len(caught.value.details()) < 300
        for payload, field in bad_bytes_cases():
            with pytest.raises(grpc.RpcError) as caught:
                list(channel.unary_stream("/kvrelay.v1.Gateway/Generate")(payload, timeout=30))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
            detail = error_detail(caught.value)  # type: ignore[arg-type]
            assert detail is not None and detail.field == field

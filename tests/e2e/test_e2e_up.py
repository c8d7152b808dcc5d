"""`kvrelay generate` and `kvrelay policies` against the stack `kvrelay up` started (the
session fixture; its teardown checks that SIGTERM stops every service), a SIGKILLed worker
that the launcher restarts while the rest keeps serving, and a launcher that dies without
stopping its services takes them along."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest
from e2e_helpers import E2E_ENV, KVRELAY, UpStack, alive, wait_gone

from services.gateway.client import GatewayClient, generate_request
from services.kvpolicy.manifest import default_manifests
from services.model import LoadedModel

pytestmark = pytest.mark.timeout(120)
DEFAULT_POLICIES = ("full", "window", "sink-recent", "snapkv", "snapkv-pyramid", "snapkv-adakv")


def kvrelay(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVRELAY, *args], capture_output=True, text=True, timeout=90, env={**os.environ, **E2E_ENV})


def test_up_announces_every_service_and_the_gateway(stack: UpStack) -> None:
    for name, address in [("policy", stack.policy_address), ("gateway", stack.gateway_address),
                          *zip(("prefill-0", "prefill-1"), stack.prefill_addresses, strict=True),
                          *zip(("decode-0", "decode-1"), stack.decode_addresses, strict=True)]:
        assert re.search(rf"ready {name}\s+{re.escape(address)}\s", stack.output.text), name
    assert f"kvrelay gateway listening on {stack.gateway_address}" in stack.output.text


def test_generate_streams_tokens_then_the_summary(stack: UpStack) -> None:
    done = kvrelay("generate", "the quiet river crosses the old bridge", "--gateway", stack.gateway_address,
                   "--policy", "snapkv", "--max-tokens", "3", "--stream")
    assert done.returncode == 0, done.stdout + done.stderr
    for item in ("ttft", "tokens (prompt / output)", "KV bytes retained", "bytes moved", "workers (prefill / decode)"):
        assert item in done.stdout, done.stdout
    bad = kvrelay("generate", "   ", "--gateway", stack.gateway_address)
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stdout and "text" in bad.stdout


def test_policies_lists_the_defaults_and_registers_manifest_files(
    stack: UpStack, loaded: LoadedModel, tmp_path: Path
) -> None:
    custom = replace(default_manifests(loaded.tensor_contract, budget_fraction=0.5)["snapkv"],
                     name="my-snapkv", policy_manifest_id="my-snapkv@1")
    (tmp_path / "my-snapkv.json").write_bytes(custom.canonical_json())
    listed = kvrelay("policies", "--policy-address", stack.policy_address,
                     "--register", str(tmp_path / "my-snapkv.json"))
    assert listed.returncode == 0, listed.stdout + listed.stderr
    for name in (*DEFAULT_POLICIES, "my-snapkv"):
        assert re.search(rf"^\W*{re.escape(name)}\s", listed.stdout, re.MULTILINE), (name, listed.stdout)
    assert re.search(r"my-snapkv\s.*50% of prompt", listed.stdout), listed.stdout


@pytest.mark.slow
def test_a_killed_decode_worker_is_restarted_and_the_rest_keeps_serving(stack: UpStack) -> None:
    victim = stack.pids["decode-1"]
    others = {name: pid for name, pid in stack.pids.items() if name != "decode-1"}
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    match = stack.output.wait_for(rf"ready decode-1\s+\S+\s+pid (?!{victim}\b)(\d+)", 100)
    ready_s = time.monotonic() - killed
    stack.pids["decode-1"] = int(match.group(1))  # the session's teardown checks every service
    assert stack.up.poll() is None and all(alive(pid) for pid in others.values()), stack.output.text[-2000:]
    assert "restarting decode-1 in 0.5 s" in stack.output.text

    # Requests reach the restarted worker through the prefill workers (no stale channel).
    served_by: list[str] = []
    with GatewayClient(stack.gateway_address, timeout_s=30) as client:
        while stack.decode_addresses[1] not in served_by and time.monotonic() - killed < ready_s + 10:
            result = client.generate(generate_request("the old bridge", policy="full", max_tokens=2))
            served_by.append(result.summary.decode_worker)
    reached_s = time.monotonic() - killed
    print(f"decode-1 SIGKILLed: healthy again after {ready_s:.1f} s, serving {reached_s - ready_s:.2f} s later")
    assert stack.decode_addresses[1] in served_by, served_by
    assert reached_s - ready_s < 5.0


PARENT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from services.launcher.stack import Stack, StackConfig
    stack = Stack(StackConfig.with_free_ports(Path(sys.argv[1]), log_dir=Path(sys.argv[2])))
    service = stack._policy()
    service.spawn(stack._env())
    service.wait_healthy(time.monotonic() + 60)
    print(service.pid, flush=True)
    time.sleep(600)
""")


def test_services_die_with_a_killed_launcher(checkpoint: Path, tmp_path: Path) -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(checkpoint), str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert alive(child)
        parent.kill()
        parent.wait(timeout=10)
        assert wait_gone([child], 20) == []
    finally:
        if parent.poll() is None:
            parent.kill()

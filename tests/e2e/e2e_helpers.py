"""Helpers shared by the end-to-end tests (imported by basename; tests have no packages)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.demo import needle
from services.launcher.stack import ServiceProcess, Stack, StackConfig, WorkerPorts
from services.model import LoadedModel
from services.policy import Fence, PolicyClient, PolicyClientConfig

KVRELAY = (sys.executable, "-m", "kvrelay")
# Through the environment, as a deployment would: prefill transfers give up after 10 s (a lost
# decode worker must not hold a prompt longer), queues hold 32, the gateway re-checks worker
# health every half second.
E2E_ENV = {
    "KVRELAY_PREFILL_TRANSFER_TIMEOUT_S": "10",
    "KVRELAY_PREFILL_MAX_QUEUED": "32",
    "KVRELAY_HEALTH_INTERVAL_S": "0.5",
    "COLUMNS": "200",
}


def save_tiny_checkpoint(directory: Path) -> Path:
    """2 layers, d_model 64, H_q 4, H_kv 2, d_h 16, float32; the needle tokenizer. Weights are
    drawn wider than usual (std 0.1) so greedy choices are never near-ties."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(needle.vocabulary()), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, initializer_range=0.1,
    )
    LlamaForCausalLM(config).eval().save_pretrained(directory, safe_serialization=True)
    needle.build_tokenizer().save(str(directory / "tokenizer.json"))
    return directory


def free_base_port() -> int:
    """A base port for `kvrelay up --base-port` whose 24 successors are free right now."""
    import socket

    for base in range(41000, 60000, 97):
        sockets: list[socket.socket] = []
        try:
            for port in range(base, base + 24):
                sockets.append(socket.socket())
                sockets[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no free port range")


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.1)
    return [pid for pid in pids if alive(pid)]


class Output:
    """A process's output lines, collected on a thread; `wait_for` polls them with a deadline."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        threading.Thread(target=self._read, args=(process,), daemon=True).start()

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if match := re.search(pattern, self.text):
                return match
            time.sleep(0.1)
        raise AssertionError(f"{pattern!r} not printed in {timeout_s}s:\n{self.text}")


class UpStack:
    """The services a `kvrelay up` process started: addresses from the same StackConfig the
    command builds, process ids from its output; `launch_decode` starts a spare worker."""

    def __init__(self, config: StackConfig, up: subprocess.Popen[str], output: Output) -> None:
        self.config = config
        self.up = up
        self.output = output
        self.pids = {name: int(pid) for name, pid in re.findall(r"ready (\S+)\s+\S+\s+pid (\d+)", output.text)}
        self._stack = Stack(config)
        self.gateway_address = self._stack.gateway_address
        self.policy_address = self._stack.policy_address
        self.prefill_addresses = self._stack.prefill_addresses
        self.decode_addresses = self._stack.decode_addresses

    def launch_decode(self, name: str, ports: WorkerPorts) -> ServiceProcess:
        return self._stack.launch_decode(name, ports)

    def launch_prefill(self, name: str, port: int, args: tuple[str, ...] = ()) -> ServiceProcess:
        return self._stack.launch_prefill(name, port, args)

    def dead(self) -> list[str]:
        return [name for name, pid in self.pids.items() if not alive(pid)]


def not_serving(stack: UpStack) -> dict[str, str]:
    """Every service of `stack` whose gRPC health does not say SERVING, with what it said."""
    found = {}
    for address in (stack.gateway_address, stack.policy_address, *stack.prefill_addresses, *stack.decode_addresses):
        with grpc.insecure_channel(address) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            except grpc.RpcError as exc:
                found[address] = exc.code().name  # type: ignore[attr-defined]
                continue
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            found[address] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return found


def wait_every_service_serving(stack: UpStack, timeout_s: float) -> float:
    """Seconds until every service of `stack` reports SERVING (a test that upset the shared
    stack leaves it settled, as a Kubernetes readiness gate would see it)."""
    started = time.monotonic()
    while (left := not_serving(stack)) and time.monotonic() - started < timeout_s:
        time.sleep(0.1)
    assert not left, f"not SERVING {timeout_s:g} s on: {left}"
    return time.monotonic() - started


def needle_ids(loaded: LoadedModel, tokens: int, seed: int) -> list[int]:
    """Token ids of a needle prompt of exactly `tokens` tokens (the question at the end)."""
    text = needle.build_prompt(tokens, 0.4, needle.Placement.END, seed=seed).text
    return loaded.require_tokenizer().encode(text)


async def get_fence(policy_address: str, request_id: str) -> Fence:
    async with PolicyClient(PolicyClientConfig(policy_address, timeout_s=5.0)) as client:
        return await client.get_fence(request_id)


def fence_of(policy_address: str, request_id: str) -> Fence:
    """`get_fence` for tests without an event loop."""
    return asyncio.run(get_fence(policy_address, request_id))

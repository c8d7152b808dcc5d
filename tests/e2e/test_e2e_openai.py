"""The gateway's OpenAI-compatible HTTP front on a live local stack (policy service + Redis,
prefill, decode, gateway with `--http-port`: separate processes), driven with the official
`openai` client: completions and chat, streamed and not, give the text the gRPC `Generate`
gives for the same request; `kv_policy` picks the manifest per request; stop strings cut the
output where a brute-force search of the uncut output says; every invalid parameter is a 400
naming it (404 for an unknown model); a client that disconnects mid-stream frees the decode
worker's KV, and so does a request cancelled at any point before its stream opened (a decode
the gateway never streams is freed once the request ends); the request is one trace with the
workers' spans; the auth hook's 401/403."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
from e2e_helpers import E2E_ENV

from services.demo import needle
from services.gateway.errors import PermissionDenied, Unauthenticated
from services.launcher.stack import Stack, StackConfig
from services.model.loader import read_checkpoint
from services.policy import PolicyClient, PolicyClientConfig
from services.redis_embedded import free_loopback_port
from services.rpc.kvrelay.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "services" / "telemetry"))
from telemetry_helpers import SERVER_KIND, OtlpReceiver, sample, scrape  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MODEL = "openai-ckpt"
PROMPT = needle.build_prompt(160, 0.4, needle.Placement.END, seed=3).text
# Word-level: the needle vocabulary has these words, so the prompt tokenizes without <unk>.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }} . {% endfor %}"
                 "{% if add_generation_prompt %}what is the code ?{% endif %}")
ROLES = ("gateway", "policy", "prefill", "decode")


@dataclass(frozen=True)
class Served:
    stack: Stack
    receiver: OtlpReceiver
    metrics: dict[str, int]

    def client(self, **options: object) -> openai.OpenAI:
        settings: dict[str, object] = {"timeout": 60, **options}
        return openai.OpenAI(base_url=f"{self.stack.http_url}/v1", api_key="unused", max_retries=0,
                             **settings)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def served(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model = tmp_path_factory.mktemp("openai") / MODEL
    shutil.copytree(checkpoint, model)
    (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    receiver = OtlpReceiver()
    metrics = {role: free_loopback_port() for role in ROLES}
    env = {**E2E_ENV, "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
           "OTEL_TRACES_SAMPLER": "parentbased_always_on", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    config = StackConfig.with_free_ports(
        model, http_port=free_loopback_port(), log_dir=tmp_path_factory.mktemp("openai-logs"), env=tuple(env.items()),
        extra_args=tuple((role, ("--metrics-port", str(port))) for role, port in metrics.items()),
    )
    stack = Stack(config)
    try:
        stack.start()
        yield Served(stack, receiver, metrics)
    finally:
        stack.stop()
        receiver.stop()


def grpc_text(served: Served, max_tokens: int, policy: str = "") -> str:
    request = gateway_pb2.GenerateRequest(text=PROMPT, detokenize=True,
                                          sampling=common_pb2.SamplingParams(max_tokens=max_tokens))
    if policy:
        request.manifest.by_name.name = policy
    with grpc.insecure_channel(served.stack.gateway_address) as channel:
        events = list(gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=60))
    return "".join(e.token.text for e in events if e.HasField("token"))


def test_completion_and_chat_streamed_and_not_match_grpc(served: Served) -> None:
    client = served.client()
    assert [m.id for m in client.models.list()] == [MODEL]
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    choice = reply.choices[0]
    assert choice.text == grpc_text(served, 12) and choice.finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 12 and reply.usage.prompt_tokens > 100
    kv = (reply.model_extra or {})["kvrelay"]
    assert len(kv["policy_sha256"]) == 64 and kv["retained_rows"] > 0 and kv["bytes_moved"] > 0
    assert kv["generations"]["state"] >= 1 and kv["ttft_ms"] > 0 and kv["tpot_ms"] > 0 and len(kv["trace_id"]) == 32

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12

    messages: list[Mapping[str, str]] = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,  # type: ignore[arg-type]
                                          temperature=0, seed=7, user="tester")
    content = chat.choices[0].message.content
    assert content and chat.choices[0].message.role == "assistant" and chat.usage is not None
    streamed = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,  # type: ignore[arg-type]
                                                   temperature=0, stream=True))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == content
    assert (streamed[-1].model_extra or {})["kvrelay"]["request_id"].startswith("gen-")


def test_kv_policy_per_request(served: Served) -> None:
    client = served.client()
    summaries = {}
    for policy in ("full", "snapkv"):
        reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                          extra_body={"kv_policy": policy})
        summaries[policy] = (reply.model_extra or {})["kvrelay"]
        assert reply.choices[0].text == grpc_text(served, 4, policy)
    assert summaries["full"]["policy_sha256"] != summaries["snapkv"]["policy_sha256"]
    assert summaries["full"]["omitted_rows"] == 0 and summaries["snapkv"]["omitted_rows"] > 0
    by_sha = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                       extra_body={"kv_policy": "sha256:" + summaries["full"]["policy_sha256"]})
    assert (by_sha.model_extra or {})["kvrelay"]["policy_sha256"] == summaries["full"]["policy_sha256"]


def test_stop_strings_cut_where_the_uncut_output_says(served: Served) -> None:
    client = served.client()
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    words = full.split()
    assert len(words) >= 8, full
    stop = f" {words[5]}"  # its first occurrence decides, wherever that is
    expected = full[: full.index(stop)]
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                      stop=[stop, "never-written"])
    assert reply.choices[0].text == expected and reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens < 24
    assert (reply.model_extra or {})["kvrelay"]["retained_rows"] > 0
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


INVALID = [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": 0.0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"seed": -3}, "seed"),
    ({"n": 2}, "n"),
    ({"stop": ["ok", ""]}, "stop[1]"),
    ({"prompt": "   "}, "prompt"),
    ({"prompt": [1, 99_999]}, "prompt[1]"),
    ({"extra_body": {"kv_policy": "no-such-policy"}}, "kv_policy"),
    ({"extra_body": {"kv_policy": "sha256:zz"}}, "kv_policy"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"presence_penalty": 1.0}, "presence_penalty"),
    ({"user": 5}, "user"),
]


@pytest.mark.parametrize(("change", "param"), INVALID, ids=[p for _, p in INVALID])
def test_an_invalid_parameter_is_a_400_naming_it(served: Served, change: dict[str, object], param: str) -> None:
    arguments: dict[str, object] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **change}
    with pytest.raises(openai.BadRequestError) as caught:
        served.client().completions.create(**arguments)  # type: ignore[call-overload]
    assert caught.value.status_code == 400 and caught.value.param == param, caught.value.body
    assert isinstance(caught.value.body, dict) and caught.value.body["type"] == "invalid_request_error"


def test_a_stream_refused_before_its_first_token_gets_its_status(served: Served) -> None:
    """The status line waits for the first event: an unknown policy (found by the orchestrator,
    after validation) is a 400 for a stream too, not a 200 with an error event."""
    with pytest.raises(openai.BadRequestError) as caught:
        served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, stream=True,
                                           extra_body={"kv_policy": "no-such-policy"})
    assert caught.value.param == "kv_policy"


@pytest.mark.parametrize(("messages", "param"), [
    ([], "messages"),
    ([{"role": "tool", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": "the"}, {"role": "user", "content": " "}], "messages[1].content"),
])
def test_an_invalid_chat_message_is_named(served: Served, messages: list[dict[str, str]], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        served.client().chat.completions.create(model=MODEL, messages=messages)  # type: ignore[arg-type]
    assert caught.value.param == param


def test_an_unknown_model_is_a_404(served: Served) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        served.client().completions.create(model="gpt-4o", prompt=PROMPT)
    assert caught.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        served.client().models.retrieve("gpt-4o")


def decode_kv(served: Served) -> tuple[float, float]:
    samples = scrape(served.metrics["decode"])
    return sample(samples, "kvrelay_decode_requests_active"), sample(samples, "kvrelay_decode_kv_reserved_bytes")


def wait_decode_idle(served: Served, timeout_s: float) -> tuple[float, float]:
    deadline = time.monotonic() + timeout_s
    while (held := decode_kv(served)) != (0.0, 0.0) and time.monotonic() < deadline:
        time.sleep(0.1)
    return held


def log_errors(served: Served, offsets: dict[Path, int]) -> dict[str, list[str]]:
    """ERROR lines (and context-var complaints of a generator unwound elsewhere) since `offsets`."""
    found = {}
    for log, offset in offsets.items():
        with log.open("rb") as handle:
            handle.seek(offset)
            lines = handle.read().decode(errors="replace").splitlines()
        bad = [line[:200] for line in lines if " ERROR " in line or "different Context" in line]
        if bad:
            found[log.name] = bad
    return found


def test_a_client_that_disconnects_mid_stream_frees_the_decode_kv(served: Served) -> None:
    assert wait_decode_idle(served, 10) == (0.0, 0.0)
    offsets = {log: log.stat().st_size for log in served.stack.log_dir.glob("*.log")}
    served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)  # one 200
    tokens_before = sample(scrape(served.metrics["decode"]), "kvrelay_decode_tokens_total")
    stream = served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=3500, temperature=0,
                                                stream=True)
    for received, _chunk in enumerate(stream, 1):
        if received == 5:
            break
    active, reserved = decode_kv(served)
    assert active == 1.0 and reserved > 0, "the request should still be decoding"
    stream.close()  # the connection goes away mid-stream
    assert wait_decode_idle(served, 15) == (0.0, 0.0)
    tokens = sample(scrape(served.metrics["decode"]), "kvrelay_decode_tokens_total") - tokens_before
    assert tokens < 3000, f"the decode worker decoded {tokens} tokens: it was not stopped"
    gateway = scrape(served.metrics["gateway"])
    assert sample(gateway, "kvrelay_http_requests_total", route="/v1/completions", status="499") >= 1
    assert sample(gateway, "kvrelay_http_requests_total", route="/v1/completions", status="200") >= 1
    assert sample(gateway, "kvrelay_http_request_duration_seconds_count", route="/v1/completions") >= 2
    for _ in range(2):  # a chat stream and a non-streamed request cut off the same way
        chat = served.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                                       max_tokens=3500, temperature=0, stream=True)
        next(iter(chat))
        chat.close()
    assert wait_decode_idle(served, 15) == (0.0, 0.0)
    tokens_before = sample(scrape(served.metrics["decode"]), "kvrelay_decode_tokens_total")
    with pytest.raises(openai.APITimeoutError):  # the client gives up on a non-streamed request
        served.client(timeout=1.0).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3500, temperature=0)
    assert wait_decode_idle(served, 15) == (0.0, 0.0)
    tokens = sample(scrape(served.metrics["decode"]), "kvrelay_decode_tokens_total") - tokens_before
    assert tokens < 3000, f"the decode worker decoded {tokens} tokens: it was not stopped"
    time.sleep(1.0)  # a generator finalised elsewhere would be logged by now (next GC)
    assert log_errors(served, offsets) == {}


async def decode_state(served: Served) -> tuple[float, float, float]:
    """(requests active, KV bytes reserved, tokens decoded so far) on the decode worker."""
    samples = await asyncio.to_thread(scrape, served.metrics["decode"])
    return (sample(samples, "kvrelay_decode_requests_active"), sample(samples, "kvrelay_decode_kv_reserved_bytes"),
            sample(samples, "kvrelay_decode_tokens_total"))


async def poll_decode(served: Served, done: Callable[[tuple[float, float, float]], bool],
                      timeout_s: float) -> tuple[float, float, float]:
    """The decode worker's state once `done` holds for it, or the last one seen at `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not done(state := await decode_state(served)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return state


async def test_a_decode_whose_stream_never_opens_is_freed_once_the_request_ends(served: Served) -> None:
    """What a gateway leaves when its client goes away after the prefill and before the decode
    stream reaches the decode worker (a disconnect of the HTTP front, a cancelled Generate): the
    prefill worker handed the view over, the decode worker verified it and decodes, the gateway
    ended the request and opens no stream. Here the test is that gateway, so the window is as
    wide as it likes. The decode worker frees the request within a short bound of its end,
    rather than decoding all of it unread until its lease (60 s) expires."""
    assert await poll_decode(served, lambda s: s[:2] == (0.0, 0.0), 10) is not None
    prompt = read_checkpoint(served.stack.config.checkpoint).require_tokenizer().encode(PROMPT)
    request_id = f"orphan-{uuid.uuid4().hex[:8]}"
    decode_address = served.stack.decode_addresses[0]
    async with PolicyClient(PolicyClientConfig(served.stack.policy_address, timeout_s=10.0)) as policy:
        full = max(await policy.list_manifests("full"), key=lambda ref: ref.policy_generation)
        _, _, tokens_before = await decode_state(served)
        fence = await policy.begin_request(request_id)
        message = prefill_pb2.PrefillRequest(
            request_id=request_id, request_generation=fence.request_generation, prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(max_tokens=3500), manifest_sha256=full.sha256,
            decode_worker_address=decode_address, decode_worker_id=decode_address)
        async with grpc.aio.insecure_channel(served.stack.prefill_addresses[0]) as channel:
            await prefill_pb2_grpc.PrefillWorkerStub(channel).Prefill(message, timeout=60)
        decoding = await poll_decode(served, lambda s: s[0] == 1.0 and s[2] > tokens_before, 20)
        assert decoding[0] == 1.0 and decoding[1] > 0, f"the view should be verified and decoding: {decoding}"
        await policy.end_request(request_id, fence.request_generation)
        ended_at = time.monotonic()
        active, reserved, tokens = await poll_decode(served, lambda s: s[:2] == (0.0, 0.0), 10)
    assert (active, reserved) == (0.0, 0.0), "the decode worker still holds the ended request"
    freed_s = time.monotonic() - ended_at
    assert freed_s < 5.0, f"freed {freed_s:.1f} s after the request ended"
    assert tokens - tokens_before < 3000, f"the decode worker decoded {tokens - tokens_before} tokens unread"


@pytest.mark.parametrize("cancel_after_s", [0.0, 0.05, 0.15, 0.4])
async def test_a_generate_cancelled_at_any_point_frees_the_decode_kv(served: Served, cancel_after_s: float) -> None:
    """A gRPC Generate the client cancels before its first token — waiting for workers, in
    prefill, in the handoff or the first events, wherever the delay lands — leaves nothing
    decoding or reserved on the decode worker beyond a short bound."""
    assert await poll_decode(served, lambda s: s[:2] == (0.0, 0.0), 10) is not None
    _, _, tokens_before = await decode_state(served)
    request = gateway_pb2.GenerateRequest(text=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=3500))
    async with grpc.aio.insecure_channel(served.stack.gateway_address) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=60)
        reading = asyncio.ensure_future(call.read())
        await asyncio.wait({reading}, timeout=cancel_after_s)
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await reading
    active, reserved, tokens = await poll_decode(served, lambda s: s[:2] == (0.0, 0.0), 5)
    assert (active, reserved) == (0.0, 0.0), "the cancelled request is still decoding"
    assert tokens - tokens_before < 3000, f"the decode worker decoded {tokens - tokens_before} tokens unread"


def test_an_http_request_is_one_trace_with_the_workers_spans(served: Served) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    headers = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    reply = served.client(default_headers=headers).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                                                      temperature=0)
    assert (reply.model_extra or {})["kvrelay"]["trace_id"] == trace_id

    def complete(spans: list) -> bool:  # type: ignore[type-arg]
        names = {(s.service, s.name) for s in spans if s.trace_id == trace_id}
        return {("kvrelay-gateway", "POST /v1/completions"), ("kvrelay-prefill", "kv.select"),
                ("kvrelay-decode", "kv.verify")} <= names

    spans = served.receiver.wait_for(complete, 20)
    assert complete(spans), sorted({(s.service, s.name) for s in spans if s.trace_id == trace_id})
    root = next(s for s in spans if s.name == "POST /v1/completions" and s.trace_id == trace_id)
    assert root.kind == SERVER_KIND and root.parent_span_id == "00f067aa0ba902b7"


async def check_key(headers: Mapping[str, str]) -> None:
    """A stand-in for API keys: 'good' may call, 'reader' is known but not allowed."""
    key = headers.get("authorization", "").removeprefix("Bearer ")
    if key == "reader":
        raise PermissionDenied("this key may not generate")
    if key != "good":
        raise Unauthenticated("unknown API key", field="authorization")


async def test_the_authentication_hook_maps_to_401_and_403(served: Served) -> None:
    from services.gateway import GatewayConfig, WorkerSource
    from services.gateway.config import HttpConfig
    from services.gateway.server import GatewayServer
    from services.rpc.server import ServerConfig

    stack = served.stack
    config = GatewayConfig(
        checkpoint=stack.config.checkpoint, policy_address=stack.policy_address,
        prefill_workers=WorkerSource.parse(",".join(stack.prefill_addresses), "prefill_workers"),
        decode_workers=WorkerSource.parse(",".join(stack.decode_addresses), "decode_workers"),
        server=ServerConfig(port=0, shutdown_grace_s=0.5), http=HttpConfig(port=0), register_default_manifests=False,
    )
    gateway = await GatewayServer.start(config, authenticate=check_key)
    try:
        assert gateway.http is not None
        url = f"{gateway.http.url}/v1"
        for key, error in (("wrong", openai.AuthenticationError), ("reader", openai.PermissionDeniedError)):
            client = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=30)
            with pytest.raises(error) as caught:
                await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
            assert caught.value.status_code == (401 if key == "wrong" else 403)
            with pytest.raises(error):
                await client.models.list()
        good = openai.AsyncOpenAI(base_url=url, api_key="good", max_retries=0, timeout=30)
        deadline = time.monotonic() + 20  # the new gateway finds its workers by health checks
        while True:
            try:
                reply = await good.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
                break
            except openai.APIStatusError as exc:
                if exc.status_code != 503 or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        assert reply.usage is not None and reply.usage.completion_tokens == 2
    finally:
        await gateway.stop(0)

"""The `kvrelay` command line. Each subcommand imports its stage lazily so that
`kvrelay --help` stays fast and a missing optional dependency only affects its command."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="kvrelay: disaggregated LLM serving with versioned KV-cache policies.")
DEFAULT_MODEL_HELP = "default: the bundled SmolLM2-135M-Instruct GGUF"


def served_checkpoint(checkpoint: Path | None) -> Path:
    """`checkpoint`, or the default model (services.model.default); without it, exit 1 with the
    command that installs it."""
    if checkpoint is not None:
        return checkpoint
    from services.model.default import DefaultModelMissing, default_checkpoint

    try:
        return default_checkpoint()
    except DefaultModelMissing as exc:
        typer.echo(f"kvrelay: {exc}", err=True)
        raise typer.Exit(1) from None


@app.command()
def demo(
    core: bool = typer.Option(False, "--core", help="Only the policy core on a synthetic prompt (no model, no services)."),
    checkpoint: Path | None = typer.Option(None, help=f"Checkpoint to serve: a .gguf file or an HF directory ({DEFAULT_MODEL_HELP})."),
    context_tokens: int = typer.Option(3000, help="Tokens of real text (the Python language reference) around the needle."),
) -> None:
    """Start the local stack, ask one question hidden in a long text under full, snapkv and snapkv-recall; print answers, TTFT/TPOT and the byte ledger."""
    if core:
        from services.kvpolicy.demo import run_demo

        run_demo()
        return
    from services.launcher.demo import run_stack_demo
    from services.launcher.stack import StackError

    try:
        run_stack_demo(served_checkpoint(checkpoint), context_tokens=context_tokens)
    except StackError as exc:
        typer.echo(f"kvrelay demo: {exc}", err=True)
        raise typer.Exit(1) from None


@app.command("policy-demo")
def policy_demo() -> None:
    """Build a manifest, run SnapKV + allocation on a synthetic prompt, print retained rows and the byte ledger."""
    from services.kvpolicy.demo import run_demo

    run_demo()


@app.command()
def up(
    checkpoint: Path | None = typer.Option(None, envvar="KVRELAY_CHECKPOINT", help=f"Checkpoint to serve: a .gguf file or an HF directory ({DEFAULT_MODEL_HELP})."),
    dtype: str | None = typer.Option(None, envvar="KVRELAY_DTYPE", help="Workers' dtype (default: the checkpoint's)."),
    prefill: int = typer.Option(1, help="Prefill workers (ports 50062, 50072, ...)."),
    decode: int = typer.Option(1, help="Decode workers (ports 50063/50064, 50073/50074, ...)."),
    threads: int = typer.Option(1, help="torch threads per service."),
    redis_url: str | None = typer.Option(None, envvar="REDIS_URL", help="Use this Redis instead of an embedded one."),
    log_dir: Path | None = typer.Option(None, help="Service logs (default: a new temporary directory)."),
    base_port: int = typer.Option(50051, help="Gateway port; policy +10, prefill +11, decode +12 (rendezvous +13), extra workers +10 each."),
    metrics_base_port: int = typer.Option(9091, help="Gateway /metrics port; policy +1, prefill +2, decode +3, extra workers +10 each (0: metrics off)."),
) -> None:
    """Run a full local deployment on this machine: policy service (+ embedded Redis), prefill, decode, gateway."""
    from services.launcher.stack import StackConfig
    from services.launcher.up import run_up

    config = StackConfig.with_counts(
        served_checkpoint(checkpoint), prefill=prefill, decode=decode, base_port=base_port, dtype=dtype,
        threads=threads, redis_url=redis_url, log_dir=log_dir, metrics_base_port=metrics_base_port,
    )
    raise typer.Exit(run_up(config))


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="Prompt text (tokenized by the gateway)."),
    policy: str | None = typer.Option(None, help="Policy name (default: the gateway's default policy)."),
    max_tokens: int | None = typer.Option(None, help="Output tokens (default: the gateway's default)."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_k: int = typer.Option(0),
    top_p: float = typer.Option(0.0, help="0 or 1 disables nucleus filtering."),
    seed: int = typer.Option(0),
    stream: bool = typer.Option(False, "--stream", help="Print tokens as they arrive."),
    chat: bool = typer.Option(False, "--chat", help="Send the prompt as a user message through the checkpoint's chat template."),
    system: str | None = typer.Option(None, help="System message of the chat (implies --chat)."),
    gateway: str = typer.Option("127.0.0.1:50051", envvar="KVRELAY_GATEWAY_ADDRESS", help="host:port of the gateway."),
    timeout_s: float = typer.Option(300.0, help="Deadline of the whole call."),
) -> None:
    """Send one generation request to the gateway; print the answer, then the summary."""
    import grpc
    from rich.console import Console

    from services.gateway.client import ChatHistory, GatewayClient, generate_request
    from services.gateway.console import print_generation

    text_or_chat = ChatHistory(system).prompt(prompt) if chat or system is not None else prompt
    request = generate_request(text_or_chat, policy=policy, max_tokens=max_tokens, temperature=temperature,
                               top_k=top_k, top_p=top_p, seed=seed)
    console = Console()
    try:
        with GatewayClient(gateway, timeout_s=timeout_s) as client:
            print_generation(client, request, console, stream=stream)
    except grpc.RpcError as exc:
        console.print(f"[red]{exc.code().name}[/red]: {exc.details()}")
        raise typer.Exit(1) from None


@app.command("chat")
def chat_command(
    system: str | None = typer.Option(None, help="System message at the start of the conversation."),
    policy: str | None = typer.Option(None, help="Policy name (default: the gateway's default policy)."),
    max_tokens: int | None = typer.Option(None, help="Output tokens per reply (default: the gateway's default)."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_k: int = typer.Option(0),
    top_p: float = typer.Option(0.0, help="0 or 1 disables nucleus filtering."),
    seed: int = typer.Option(0),
    summary: bool = typer.Option(False, "--summary", help="After each reply, a line with tokens, TTFT/TPOT and the byte ledger."),
    gateway: str = typer.Option("127.0.0.1:50051", envvar="KVRELAY_GATEWAY_ADDRESS", help="host:port of the gateway."),
    timeout_s: float = typer.Option(300.0, help="Deadline of each reply."),
) -> None:
    """Chat with the served model: reads turns from stdin, streams each reply; /reset, /exit."""
    from rich.console import Console

    from services.gateway.client import ChatHistory, GatewayClient, generate_request
    from services.gateway.console import chat_loop
    from services.rpc.kvrelay.v1 import gateway_pb2

    def make_request(messages: gateway_pb2.ChatMessages) -> gateway_pb2.GenerateRequest:
        return generate_request(messages, policy=policy, max_tokens=max_tokens, temperature=temperature,
                                top_k=top_k, top_p=top_p, seed=seed)

    with GatewayClient(gateway, timeout_s=timeout_s) as client:
        chat_loop(client, ChatHistory(system), make_request, Console(), summary=summary)


@app.command()
def policies(
    policy_address: str = typer.Option("127.0.0.1:50061", envvar="KVRELAY_POLICY_ADDRESS", help="host:port of the policy service."),
    register: list[Path] = typer.Option([], help="Register this manifest JSON file first (repeatable)."),
) -> None:
    """List the registered KV visibility policies (optionally registering manifest files first)."""
    import asyncio

    from rich.console import Console

    from services.gateway.console import policies_table, registered_policies
    from services.policy import PolicyError

    console = Console()
    try:
        manifests = asyncio.run(registered_policies(policy_address, register))
    except PolicyError as exc:
        console.print(f"[red]{type(exc).__name__}[/red]: {exc}")
        raise typer.Exit(1) from None
    console.print(policies_table(manifests))


@app.command("train-demo")
def train_demo(
    out: Path | None = typer.Option(None, help="Output directory (default: the bundled services/model/demo_checkpoint)."),
    seed: int = typer.Option(0, help="Seed of initialization and of the training documents."),
    threads: int = typer.Option(1, help="torch CPU threads."),
    log_file: Path | None = typer.Option(None, help="Also append progress lines to this file."),
    work_dir: Path | None = typer.Option(None, help="Write a snapshot here at every evaluation."),
) -> None:
    """Train the bundled demo checkpoint on the synthetic needle language (CPU, about an hour)."""
    from services.model.train_demo import DEMO_CHECKPOINT, TrainConfig, tee_log, train

    config = TrainConfig(out_dir=out or DEMO_CHECKPOINT, seed=seed, threads=threads, work_dir=work_dir)
    train(config, tee_log(log_file))


@app.command("eval-checkpoint")
def eval_checkpoint(
    checkpoint: Path | None = typer.Argument(None, help="Checkpoint directory (default: the bundled demo checkpoint)."),
    prompts: int = typer.Option(100, help="Held-out prompts per context length and placement."),
    lengths: str = typer.Option("512,1024,2048", help="Comma-separated context lengths in tokens."),
    backend: str = typer.Option("runtime", help="runtime (kvrelay's model runtime) or transformers (reference)."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    dtype: str | None = typer.Option(None, help="float32 / bfloat16 / float16 (default: the checkpoint's)."),
    threads: int | None = typer.Option(None, help="torch CPU threads (default: torch's choice)."),
    markdown: Path | None = typer.Option(None, help="Also write the table to this Markdown file."),
) -> None:
    """Full-cache answer accuracy on held-out needle questions (both question placements)."""
    from services.model.evaluate import EvalConfig, run
    from services.model.train_demo import DEMO_CHECKPOINT

    config = EvalConfig(context_lengths=tuple(int(n) for n in lengths.split(",")), prompts=prompts)
    run(checkpoint or DEMO_CHECKPOINT, config, backend, device, dtype, markdown, threads)


@app.command()
def convert(
    gguf: Path = typer.Argument(..., help="A llama.cpp .gguf file (llama or qwen2)."),
    out_dir: Path = typer.Argument(..., help="Directory to write the HF checkpoint into (created)."),
    dtype: str = typer.Option("float32", help="Stored weight dtype: float32 (exact dequantized values) / bfloat16 / float16."),
) -> None:
    """Write an HF safetensors directory (config, weights, tokenizer, chat template) from a GGUF file."""
    from services.model.errors import ModelError
    from services.model.gguf_convert import convert_gguf

    try:
        out = convert_gguf(gguf, out_dir, dtype)
    except ModelError as exc:
        typer.echo(f"{type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"wrote {out}")


@app.command()
def codegen(check: bool = typer.Option(False, help="Only verify that the committed stubs are current.")) -> None:
    """Regenerate services/rpc/kvrelay/v1 from proto/ (the only schema)."""
    from services.rpc.codegen import main

    raise typer.Exit(main(["--check"] if check else []))


serve_app = typer.Typer(no_args_is_help=True, help="Run a kvrelay service.")
app.add_typer(serve_app, name="serve")
bench_app = typer.Typer(help="Benchmarks that print their numbers. Without a subcommand: the whole issue-8 harness.")
app.add_typer(bench_app, name="bench")
eval_app = typer.Typer(help="Quality evaluations that write Markdown and PNG reports.")
app.add_typer(eval_app, name="eval")


@eval_app.callback(invoke_without_command=True)
def eval_main(
    ctx: typer.Context,
    checkpoint: Path | None = typer.Option(None, help="Checkpoint (default: the bundled demo checkpoint)."),
    preset: str = typer.Option("full", help="smoke (one 256-token length, 25% budget, seconds) or full (512/1K/2K, 7 depths, 10/25/50%, about 10 min on 1 thread)."),
    out: Path = typer.Option(Path("eval-out"), help="Directory for eval.md, the heat-map PNGs and trials.json."),
    prompts_per_cell: int | None = typer.Option(None, help="Prompts per (length, placement, depth); default: the preset's."),
    threads: int = typer.Option(1, help="torch CPU threads."),
    kvpress: bool = typer.Option(True, "--kvpress/--no-kvpress", help="Also compare SnapKV's kept rows with kvpress's SnapKVPress (needs kvpress)."),
    suite: str = typer.Option("needle", help="needle (the demo checkpoint's needle language) or ruler (RULER-style tasks on a real model, kvpress side by side; checkpoint " + DEFAULT_MODEL_HELP + ")."),
    resume: bool = typer.Option(False, "--resume", help="ruler: keep --out's results.jsonl and skip the trials it holds."),
) -> None:
    """Needle retrieval per policy (budgets x allocations x GQA reductions x placements, baselines), heat maps, kvpress agreement; --suite ruler: RULER-style tasks at 1K-8K."""
    if ctx.invoked_subcommand is not None:
        return
    from services.evaluation.needs import MissingDependency
    from services.evaluation.quality import PRESETS, EvalOptions, run_eval
    from services.model.train_demo import DEMO_CHECKPOINT

    if suite not in ("needle", "ruler"):
        raise typer.BadParameter("must be needle or ruler", param_hint="--suite")
    if suite == "ruler":
        _eval_ruler(served_checkpoint(checkpoint), out, preset, threads, kvpress, resume)
        return
    if preset not in PRESETS:
        raise typer.BadParameter(f"must be one of {', '.join(PRESETS)}", param_hint="--preset")
    options = EvalOptions(checkpoint=checkpoint or DEMO_CHECKPOINT, out=out, preset=preset,
                          prompts_per_cell=prompts_per_cell, threads=threads, kvpress=kvpress)
    try:
        run_eval(options)
    except MissingDependency as exc:
        hint = " (or run with --no-kvpress)" if exc.package == "kvpress" else ""
        typer.echo(f"kvrelay eval: {exc}{hint}", err=True)
        raise typer.Exit(1) from None


def _eval_ruler(checkpoint: Path, out: Path, preset: str, threads: int, kvpress: bool, resume: bool) -> None:
    """`kvrelay eval --suite ruler`."""
    from services.evaluation.needs import MissingDependency
    from services.evaluation.ruler_suite import PRESETS, SuiteOptions, run_suite

    if preset not in PRESETS:
        raise typer.BadParameter(f"must be one of {', '.join(PRESETS)}", param_hint="--preset")
    try:
        run_suite(SuiteOptions(checkpoint, out, preset, threads, kvpress, resume))
    except MissingDependency as exc:
        hint = " (or run with --no-kvpress)" if exc.package == "kvpress" else ""
        typer.echo(f"kvrelay eval: {exc}{hint}", err=True)
        raise typer.Exit(1) from None


@app.command()
def calibrate(
    checkpoint: Path = typer.Argument(..., help="Checkpoint: an HF directory (the profile goes inside) or a .gguf file (<file>.headkv_profile.safetensors beside it)."),
    method: str = typer.Option("auto", help="needle (the demo checkpoint's language), ruler (RULER needles, real tokenizers) or auto (by the tokenizer)."),
    lengths: str | None = typer.Option(None, help="Comma-separated context lengths in tokens (default: needle 512,1024,2048; ruler 1024,2048)."),
    prompts: int | None = typer.Option(None, help="Prompts per length and placement (needle, default 16) or per length, task and placement (ruler, default 6)."),
    seed: int | None = typer.Option(None, help="Seed of the calibration prompts (default: needle 9000000, ruler 30000000)."),
    out: Path | None = typer.Option(None, help="Write the profile here instead of beside the checkpoint."),
    threads: int = typer.Option(1, help="torch CPU threads."),
) -> None:
    """HeadKV retrieval-head scores per (layer, K/V head), written beside the checkpoint; prints the profile's sha256."""
    from services.evaluation.calibrate import CalibrationConfig, RulerCalibrationConfig, run

    if method not in ("auto", "needle", "ruler"):
        raise typer.BadParameter("must be auto, needle or ruler", param_hint="--method")
    overrides: dict[str, object] = {}
    if lengths is not None:
        overrides["context_lengths"] = tuple(int(n) for n in lengths.split(","))
    if prompts is not None:
        overrides["prompts"] = prompts
    if seed is not None:
        overrides["seed"] = seed
    if method == "auto" and overrides:
        method = "ruler" if not _speaks_needle_language(checkpoint) else "needle"
    config = None if method == "auto" else (RulerCalibrationConfig if method == "ruler" else CalibrationConfig)(**overrides)  # type: ignore[arg-type]
    run(checkpoint, config, threads, out)


def _speaks_needle_language(checkpoint: Path) -> bool:
    from services.evaluation.calibrate import speaks_needle_language
    from services.model.loader import read_checkpoint

    return speaks_needle_language(read_checkpoint(checkpoint).require_tokenizer())


@bench_app.callback(invoke_without_command=True)
def bench(
    ctx: typer.Context,
    preset: str = typer.Option("full", help="smoke (seconds, tiny models) or full (the issue's sweep)."),
    contexts: str | None = typer.Option(None, help="Comma-separated prompt lengths, e.g. 1K,4K,16K,32K (default: the preset's)."),
    budgets: str | None = typer.Option(None, help="Comma-separated budgets: full, fractions or percentages (default full,50%,25%,10%)."),
    models: str | None = typer.Option(None, help="Comma-separated models: demo, large (default both; none with --checkpoint)."),
    checkpoint: Path | None = typer.Option(None, help="Measure this checkpoint: a .gguf file (converted once to an HF directory that every engine loads) or an HF directory; alone unless --models names others."),
    out: Path = typer.Option(Path("bench-out"), help="Directory for bench.json, bench.md and the PNG plots."),
    threads: int | None = typer.Option(None, help="torch CPU threads of every measurement process (default 1)."),
    steps: int | None = typer.Option(None, help="Measured decode steps per configuration (default: the preset's)."),
    memory_budget_gib: float | None = typer.Option(None, help="Skip cells whose estimated peak RSS exceeds this (default 70% of available memory)."),
    kvpress: bool = typer.Option(True, "--kvpress/--no-kvpress", help="--no-kvpress skips the kvpress anchor explicitly."),
) -> None:
    """kvrelay full-cache and SnapKV decode vs transformers and kvpress, bandwidth, transfer, goals."""
    if ctx.invoked_subcommand is not None:
        return
    from services.benchmark.config import Overrides, resolve
    from services.benchmark.errors import BenchError
    from services.benchmark.harness import run_bench
    from services.model.errors import ModelError

    overrides = Overrides(contexts=contexts, budgets=budgets, models=models, threads=threads,
                          kvpress=kvpress, memory_budget_gib=memory_budget_gib, steps=steps, checkpoint=checkpoint)
    try:
        run_bench(resolve(preset, overrides), out)
    except (BenchError, ModelError) as exc:
        typer.echo(f"kvrelay bench: {exc}", err=True)
        raise typer.Exit(1) from None


@serve_app.command("policy")
def serve_policy(
    host: str = typer.Option("127.0.0.1", envvar="KVRELAY_POLICY_HOST", help="Interface to listen on (0.0.0.0 in a pod)."),
    port: int = typer.Option(50061, envvar="KVRELAY_POLICY_PORT"),
    redis_url: str | None = typer.Option(None, envvar="REDIS_URL", help="redis:// or rediss:// (user:password@ for AUTH/ACL); unset starts an embedded redis-server."),
    redis_data_dir: Path | None = typer.Option(None, envvar="KVRELAY_REDIS_DATA_DIR", help="Embedded redis only: AOF persistence here."),
    redis_appendfsync: str = typer.Option("everysec", envvar="KVRELAY_REDIS_APPENDFSYNC", help="Embedded redis only: always | everysec | no."),
    key_prefix: str = typer.Option("kvr:", envvar="KVRELAY_POLICY_KEY_PREFIX"),
    default_lease_ms: int = typer.Option(15 * 60 * 1000, envvar="KVRELAY_POLICY_LEASE_MS", help="Request lease when a call does not give one."),
    end_retention_ms: int = typer.Option(60 * 1000, envvar="KVRELAY_POLICY_END_RETENTION_MS", help="How long an ended request stays readable."),
    max_message_bytes: int = typer.Option(8 * 1024 * 1024, envvar="KVRELAY_MAX_MESSAGE_BYTES"),
    log_level: str = typer.Option("INFO", envvar="KVRELAY_LOG_LEVEL"),
    log_format: str = typer.Option("text", envvar="KVRELAY_LOG_FORMAT", help="text, or json: one object per line with trace_id, span_id, request_id."),
    metrics_port: int = typer.Option(9092, envvar="KVRELAY_POLICY_METRICS_PORT", help="Prometheus /metrics port on --host (0: off)."),
) -> None:
    """Manifests and generation fences in Redis, over gRPC (health and reflection included)."""
    import asyncio

    from policy_service.config import PolicyServiceConfig
    from policy_service.server import serve
    from services.rpc.server import ServerConfig
    from services.telemetry.process import TelemetryConfig, observed

    config = PolicyServiceConfig(
        server=ServerConfig(host=host, port=port, max_message_bytes=max_message_bytes),
        redis_url=redis_url,
        redis_data_dir=redis_data_dir,
        redis_appendfsync=redis_appendfsync,
        key_prefix=key_prefix,
        default_lease_ms=default_lease_ms,
        end_retention_ms=end_retention_ms,
    )
    telemetry = TelemetryConfig("policy", log_level, log_format, metrics_host=host, metrics_port=metrics_port)
    with observed(telemetry):
        asyncio.run(serve(config))


@serve_app.command("gateway")
def serve_gateway(
    checkpoint: Path | None = typer.Option(None, envvar="KVRELAY_CHECKPOINT", help=f"Checkpoint the workers serve, .gguf file or HF directory (its tokenizer and config; {DEFAULT_MODEL_HELP})."),
    dtype: str | None = typer.Option(None, envvar="KVRELAY_DTYPE", help="The workers' K/V dtype (default: the checkpoint's); default manifests are registered for it."),
    host: str = typer.Option("127.0.0.1", envvar="KVRELAY_GATEWAY_HOST", help="Interface to listen on (0.0.0.0 in a pod)."),
    port: int = typer.Option(50051, envvar="KVRELAY_GATEWAY_PORT"),
    policy_address: str = typer.Option("127.0.0.1:50061", envvar="KVRELAY_POLICY_ADDRESS", help="host:port of the policy service."),
    prefill_workers: str = typer.Option("127.0.0.1:50062", envvar="KVRELAY_PREFILL_WORKERS", help="host:port[,host:port...] or dns:///name:port."),
    decode_workers: str = typer.Option("127.0.0.1:50063", envvar="KVRELAY_DECODE_WORKERS", help="host:port[,host:port...] or dns:///name:port."),
    default_policy: str = typer.Option("snapkv", envvar="KVRELAY_DEFAULT_POLICY", help="Policy of requests that name none."),
    register_defaults: bool = typer.Option(True, envvar="KVRELAY_REGISTER_DEFAULT_MANIFESTS", help="Register the default manifests for the checkpoint at start-up (idempotent)."),
    default_max_tokens: int = typer.Option(64, envvar="KVRELAY_DEFAULT_MAX_TOKENS"),
    max_tokens_limit: int = typer.Option(4096, envvar="KVRELAY_MAX_TOKENS_LIMIT"),
    max_prompt_tokens: int | None = typer.Option(None, envvar="KVRELAY_MAX_PROMPT_TOKENS", help="Default: the model's context length - 1."),
    health_interval_s: float = typer.Option(2.0, envvar="KVRELAY_HEALTH_INTERVAL_S"),
    resolve_interval_s: float = typer.Option(30.0, envvar="KVRELAY_RESOLVE_INTERVAL_S", help="How often DNS worker names are re-resolved."),
    prefill_timeout_s: float = typer.Option(120.0, envvar="KVRELAY_PREFILL_TIMEOUT_S"),
    max_retries: int = typer.Option(1, envvar="KVRELAY_GATEWAY_MAX_RETRIES", help="Retries when a worker fails before the first token."),
    max_message_bytes: int = typer.Option(8 * 1024 * 1024, envvar="KVRELAY_MAX_MESSAGE_BYTES"),
    log_level: str = typer.Option("INFO", envvar="KVRELAY_LOG_LEVEL"),
    log_format: str = typer.Option("text", envvar="KVRELAY_LOG_FORMAT", help="text, or json: one object per line with trace_id, span_id, request_id."),
    metrics_port: int = typer.Option(9091, envvar="KVRELAY_GATEWAY_METRICS_PORT", help="Prometheus /metrics port on --host (0: off)."),
) -> None:
    """Client-facing Generate API: validates, picks workers, orchestrates, streams tokens and a summary."""
    import asyncio

    from services.gateway import DiscoveryConfig, GatewayConfig, WorkerSource
    from services.gateway.server import serve
    from services.rpc.server import ServerConfig
    from services.telemetry.process import TelemetryConfig, observed

    config = GatewayConfig(
        checkpoint=served_checkpoint(checkpoint),
        prefill_workers=WorkerSource.parse(prefill_workers, "prefill_workers"),
        decode_workers=WorkerSource.parse(decode_workers, "decode_workers"),
        policy_address=policy_address,
        server=ServerConfig(host=host, port=port, max_message_bytes=max_message_bytes),
        dtype=dtype,
        default_policy=default_policy,
        register_default_manifests=register_defaults,
        default_max_tokens=default_max_tokens,
        max_tokens_limit=max_tokens_limit,
        max_prompt_tokens=max_prompt_tokens,
        discovery=DiscoveryConfig(health_interval_s=health_interval_s, resolve_interval_s=resolve_interval_s),
        prefill_timeout_s=prefill_timeout_s,
        max_retries=max_retries,
    )
    telemetry = TelemetryConfig("gateway", log_level, log_format, metrics_host=host, metrics_port=metrics_port)
    with observed(telemetry):
        asyncio.run(serve(config))


@serve_app.command("prefill")
def serve_prefill(
    checkpoint: Path | None = typer.Option(None, envvar="KVRELAY_CHECKPOINT", help=f"Checkpoint: a .gguf file or an HF directory ({DEFAULT_MODEL_HELP})."),
    device: str = typer.Option("cpu", envvar="KVRELAY_DEVICE", help="cpu, cuda or cuda:N (CUDA tensors travel over NCCL)."),
    dtype: str | None = typer.Option(None, envvar="KVRELAY_DTYPE", help="K/V and compute dtype (default: the checkpoint's); manifests must declare the same."),
    host: str = typer.Option("127.0.0.1", envvar="KVRELAY_PREFILL_HOST", help="Interface to listen on (0.0.0.0 in a pod)."),
    port: int = typer.Option(50062, envvar="KVRELAY_PREFILL_PORT"),
    worker_id: str | None = typer.Option(None, envvar="KVRELAY_PREFILL_WORKER_ID", help="Default: prefill-<hostname>-<port>."),
    transfer_host: str | None = typer.Option(None, envvar="KVRELAY_PREFILL_TRANSFER_HOST", help="Address pair groups bind and advertise (the pod IP; default: --host, or this host's address when --host is a wildcard)."),
    policy_address: str = typer.Option("127.0.0.1:50061", envvar="KVRELAY_POLICY_ADDRESS", help="host:port of the policy service."),
    max_in_flight: int = typer.Option(1, envvar="KVRELAY_PREFILL_MAX_IN_FLIGHT", help="Prompts in the pipeline at once."),
    max_queued: int = typer.Option(16, envvar="KVRELAY_PREFILL_MAX_QUEUED", help="Prompts waiting for a slot; beyond: RESOURCE_EXHAUSTED."),
    max_prompt_tokens: int = typer.Option(0, envvar="KVRELAY_MAX_PROMPT_TOKENS", help="0: the model's context length."),
    chunk_size: int = typer.Option(512, envvar="KVRELAY_PREFILL_CHUNK_SIZE", help="Queries per attention/MLP chunk."),
    accept_timeout_s: float = typer.Option(5.0, envvar="KVRELAY_PREFILL_ACCEPT_TIMEOUT_S", help="Each control call to a decode worker."),
    transfer_timeout_s: float = typer.Option(30.0, envvar="KVRELAY_PREFILL_TRANSFER_TIMEOUT_S", help="The whole send stage."),
    max_pair_groups: int = typer.Option(8, envvar="KVRELAY_PREFILL_MAX_PAIR_GROUPS"),
    offload_capacity_mib: float = typer.Option(1024.0, envvar="KVRELAY_PREFILL_OFFLOAD_CAPACITY_MIB", help="Host memory for omitted rows of recallable_remote requests (0: no store; such manifests are refused)."),
    offload_lease_s: float = typer.Option(30.0, envvar="KVRELAY_PREFILL_OFFLOAD_LEASE_S", help="How long offloaded rows stay without the decode worker renewing them."),
    offload_on_full: str = typer.Option("refuse", envvar="KVRELAY_PREFILL_OFFLOAD_ON_FULL", help="refuse (the new request degrades to irrecoverable) or evict_lru (older requests lose their rows)."),
    offload_sweep_s: float = typer.Option(5.0, envvar="KVRELAY_PREFILL_OFFLOAD_SWEEP_S", help="How often expired leases and ended or fenced-out requests are dropped."),
    offload_address: str | None = typer.Option(None, envvar="KVRELAY_PREFILL_OFFLOAD_ADDRESS", help="host:port decode workers call Recall at (default: the transfer host and --port)."),
    torch_threads: int = typer.Option(0, envvar="KVRELAY_TORCH_THREADS", help="0: torch's choice."),
    max_message_bytes: int = typer.Option(8 * 1024 * 1024, envvar="KVRELAY_MAX_MESSAGE_BYTES"),
    log_level: str = typer.Option("INFO", envvar="KVRELAY_LOG_LEVEL"),
    log_format: str = typer.Option("text", envvar="KVRELAY_LOG_FORMAT", help="text, or json: one object per line with trace_id, span_id, request_id."),
    metrics_port: int = typer.Option(9093, envvar="KVRELAY_PREFILL_METRICS_PORT", help="Prometheus /metrics port on --host (0: off)."),
) -> None:
    """Prefill worker: forward → score → allocate → select → pack → offload → publish → send to a decode worker."""
    import asyncio
    import socket

    from prefill_worker.config import OffloadConfig, PrefillWorkerConfig
    from prefill_worker.server import serve
    from services.rpc.server import ServerConfig
    from services.telemetry.process import TelemetryConfig, observed
    from services.transfer import PairGroupConfig

    wildcard = host in ("0.0.0.0", "::", "")
    config = PrefillWorkerConfig(
        checkpoint=served_checkpoint(checkpoint),
        worker_id=worker_id or f"prefill-{socket.gethostname()}-{port}",
        server=ServerConfig(host=host, port=port, max_message_bytes=max_message_bytes),
        policy_address=policy_address,
        device=device,
        dtype=dtype,
        chunk_size=chunk_size,
        max_prompt_tokens=max_prompt_tokens,
        max_in_flight=max_in_flight,
        max_queued=max_queued,
        accept_timeout_s=accept_timeout_s,
        transfer_timeout_s=transfer_timeout_s,
        pair_groups=PairGroupConfig(
            max_groups=max_pair_groups,
            bind_host=transfer_host or (socket.gethostbyname(socket.gethostname()) if wildcard else host),
        ),
        torch_threads=torch_threads,
        offload=OffloadConfig(
            capacity_bytes=int(offload_capacity_mib * 1024 * 1024),
            lease_s=offload_lease_s,
            on_full=offload_on_full,
            sweep_interval_s=offload_sweep_s,
            advertise_address=offload_address or "",
        ),
    )
    telemetry = TelemetryConfig("prefill", log_level, log_format, metrics_host=host, metrics_port=metrics_port)
    with observed(telemetry):
        asyncio.run(serve(config))


@serve_app.command("decode")
def serve_decode(
    checkpoint: Path | None = typer.Option(None, envvar="KVRELAY_CHECKPOINT", help=f"Checkpoint: a .gguf file or an HF directory ({DEFAULT_MODEL_HELP})."),
    device: str = typer.Option("cpu", envvar="KVRELAY_DEVICE", help="cpu, cuda or cuda:N (CUDA tensors travel over NCCL)."),
    dtype: str | None = typer.Option(None, envvar="KVRELAY_DTYPE", help="Compute and KV cache dtype (default: the checkpoint's)."),
    host: str = typer.Option("127.0.0.1", envvar="KVRELAY_DECODE_HOST", help="Interface to listen on (0.0.0.0 in a pod)."),
    port: int = typer.Option(50063, envvar="KVRELAY_DECODE_PORT"),
    transfer_port: int = typer.Option(50064, envvar="KVRELAY_DECODE_TRANSFER_PORT", help="TCPStore rendezvous port of the pair groups."),
    transfer_host: str | None = typer.Option(None, envvar="KVRELAY_DECODE_TRANSFER_HOST", help="Address the rendezvous store and pair groups bind and advertise (the pod IP; default: --host, or this host's address when --host is a wildcard)."),
    worker_id: str | None = typer.Option(None, envvar="KVRELAY_DECODE_WORKER_ID", help="Default: decode-<hostname>-<port>."),
    policy_address: str = typer.Option("127.0.0.1:50061", envvar="KVRELAY_POLICY_ADDRESS", help="host:port of the policy service."),
    max_batch: int = typer.Option(8, envvar="KVRELAY_DECODE_MAX_BATCH", help="Requests per batched decode step."),
    kv_budget_mib: int = typer.Option(2048, envvar="KVRELAY_DECODE_KV_BUDGET_MIB", help="KV bytes accepted transfers may reserve; beyond: RESOURCE_EXHAUSTED."),
    max_new_tokens: int = typer.Option(4096, envvar="KVRELAY_MAX_TOKENS_LIMIT", help="Largest max_tokens a descriptor may ask for."),
    transfer_timeout_s: float = typer.Option(60.0, envvar="KVRELAY_DECODE_TRANSFER_TIMEOUT_S", help="Caps every transfer's deadline."),
    lease_timeout_s: float = typer.Option(60.0, envvar="KVRELAY_DECODE_LEASE_TIMEOUT_S", help="Release an accepted transfer whose stream never opens."),
    max_pair_groups: int = typer.Option(8, envvar="KVRELAY_DECODE_MAX_PAIR_GROUPS"),
    torch_threads: int = typer.Option(0, envvar="KVRELAY_TORCH_THREADS", help="0: torch's choice."),
    max_message_bytes: int = typer.Option(8 * 1024 * 1024, envvar="KVRELAY_MAX_MESSAGE_BYTES"),
    log_level: str = typer.Option("INFO", envvar="KVRELAY_LOG_LEVEL"),
    log_format: str = typer.Option("text", envvar="KVRELAY_LOG_FORMAT", help="text, or json: one object per line with trace_id, span_id, request_id."),
    metrics_port: int = typer.Option(9094, envvar="KVRELAY_DECODE_METRICS_PORT", help="Prometheus /metrics port on --host (0: off)."),
) -> None:
    """Decode worker: accept → receive → verify (receipt, fence) → continuous-batching decode → stream tokens."""
    import asyncio
    import socket

    from decode_worker.config import DecodeWorkerConfig, SchedulerConfig
    from decode_worker.server import serve
    from services.rpc.server import ServerConfig
    from services.telemetry.process import TelemetryConfig, observed
    from services.transfer import PairGroupConfig

    wildcard = host in ("0.0.0.0", "::", "")
    config = DecodeWorkerConfig(
        checkpoint=served_checkpoint(checkpoint),
        policy_address=policy_address,
        worker_id=worker_id or f"decode-{socket.gethostname()}-{port}",
        server=ServerConfig(host=host, port=port, max_message_bytes=max_message_bytes),
        transfer=PairGroupConfig(
            max_groups=max_pair_groups,
            bind_host=transfer_host or (socket.gethostbyname(socket.gethostname()) if wildcard else host),
            store_port=transfer_port,
        ),
        scheduler=SchedulerConfig(max_batch=max_batch, kv_budget_bytes=kv_budget_mib * 1024 * 1024),
        device=device,
        dtype=dtype,
        max_new_tokens=max_new_tokens,
        transfer_timeout_s=transfer_timeout_s,
        lease_timeout_s=lease_timeout_s,
        torch_threads=torch_threads,
    )
    telemetry = TelemetryConfig("decode", log_level, log_format, metrics_host=host, metrics_port=metrics_port)
    with observed(telemetry):
        asyncio.run(serve(config))


@bench_app.command("policy")
def bench_policy(
    clients: str = typer.Option("1,16,64", help="Comma-separated concurrent client counts."),
    seconds: float = typer.Option(2.0, help="Measured seconds per operation, path and client count."),
    redis_url: str | None = typer.Option(None, help="Benchmark against this Redis (default: a private embedded one)."),
    target: str | None = typer.Option(None, help="host:port of a running policy service using --redis-url."),
    pipe_commands: int = typer.Option(50_000, help="Commands per redis-cli --pipe ceiling run."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the numbers here."),
) -> None:
    """PublishState/GetFence throughput and p50/p99 vs the raw Lua-script ceiling on the same Redis."""
    import asyncio

    from policy_service.bench import BenchConfig, print_report, run_bench

    config = BenchConfig(
        concurrency=tuple(int(c) for c in clients.split(",")), seconds=seconds, redis_url=redis_url, target=target,
        pipe_commands=pipe_commands,
    )
    print_report(asyncio.run(run_bench(config)), json_out)


@bench_app.command("model")
def bench_model(
    quick: bool = typer.Option(False, help="Small sweep: contexts 512,1024,2048, 4 layers, 8 steps."),
    contexts: str | None = typer.Option(None, help="Comma-separated context lengths (default 1024,4096,16384)."),
    layers: int | None = typer.Option(None, help="Decoder layers of the random Llama (default 8)."),
    steps: int | None = typer.Option(None, help="Measured decode steps per configuration (default 32)."),
    threads: int | None = typer.Option(None, help="torch CPU threads (default: torch's choice)."),
    reference: bool = typer.Option(True, help="Also time transformers' greedy generation."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the numbers here."),
) -> None:
    """Prefill tokens/s and decode ms/token: full cache vs packed views, vs transformers."""
    from services.model.bench import BenchConfig, run

    base = BenchConfig(contexts=(512, 1024, 2048), layers=4, decode_steps=8) if quick else BenchConfig()
    config = BenchConfig(
        contexts=tuple(int(c) for c in contexts.split(",")) if contexts else base.contexts,
        layers=layers or base.layers, decode_steps=steps or base.decode_steps,
        threads=threads, reference=reference,
    )
    run(config, json_out=json_out)


@bench_app.command("transfer")
def bench_transfer(
    layers: int = typer.Option(32, help="Layers of the packed view."),
    kv_heads: int = typer.Option(8, help="K/V heads (owners) per layer."),
    rows: int = typer.Option(1024, help="Retained rows per (layer, K/V head)."),
    head_dim: int = typer.Option(128),
    dtype: str = typer.Option("bfloat16", help="K/V dtype (torch name)."),
    repeats: int = typer.Option(5, help="Warm repeats of each path."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the numbers here."),
) -> None:
    """Bytes/s of a packed view through a gloo pair group vs a plain loopback TCP copy."""
    from services.transfer.bench import (
        TransferBenchConfig,
        print_transfer_report,
        run_transfer_bench,
    )

    config = TransferBenchConfig(
        num_layers=layers, num_kv_heads=kv_heads, rows_per_head=rows, head_dim=head_dim, dtype=dtype, repeats=repeats
    )
    print_transfer_report(run_transfer_bench(config), json_out)


@bench_app.command("e2e")
def bench_e2e(
    checkpoint: Path | None = typer.Option(None, help=f"Checkpoint: a .gguf file or an HF directory ({DEFAULT_MODEL_HELP})."),
    contexts: str = typer.Option("1024,4096", help="Comma-separated prompt lengths in tokens."),
    budgets: str = typer.Option("0.25,0.10", help="Comma-separated SnapKV budget fractions."),
    max_tokens: int = typer.Option(32, help="Output tokens per request."),
    repeats: int = typer.Option(3, help="Measured requests per cell (after one warm-up)."),
    threads: int = typer.Option(1, help="torch threads per process (each service and the local run)."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the numbers here."),
) -> None:
    """TTFT and tokens/s through the gateway vs one process, full and SnapKV; transfer bytes/s vs loopback TCP."""
    from services.launcher.bench import E2EBenchConfig, run_e2e_bench

    config = E2EBenchConfig(
        checkpoint=served_checkpoint(checkpoint), contexts=tuple(int(c) for c in contexts.split(",")),
        budgets=tuple(float(b) for b in budgets.split(",")), max_tokens=max_tokens, repeats=repeats, threads=threads,
    )
    run_e2e_bench(config, json_out=json_out)


@eval_app.command("recall")
def eval_recall(
    checkpoint: Path | None = typer.Option(None, help="Checkpoint (default: the bundled demo checkpoint)."),
    preset: str = typer.Option("full", help="smoke (one context, 25% budget, 2 prompts) or full (1K/2K, 10/25/50%)."),
    prompts: int | None = typer.Option(None, help="Prompts per (placement, context); default: the preset's."),
    out: Path = typer.Option(Path("recall-eval"), help="Directory for report.md, results.json and recall.png."),
    threads: int = typer.Option(1, help="torch CPU threads."),
    tune: bool = typer.Option(False, "--tune", help="Sweep the recall knobs on tuning seeds instead of evaluating."),
) -> None:
    """Needle accuracy of full, window, sink+recent and SnapKV policies, with and without recall of omitted rows."""
    from dataclasses import replace

    from services.model.train_demo import DEMO_CHECKPOINT
    from services.offload.evaluate import PRESETS, TuneConfig, run, run_tune

    if preset not in PRESETS:
        raise typer.BadParameter(f"must be one of {', '.join(PRESETS)}", param_hint="--preset")
    if tune:
        tune_config = TuneConfig() if prompts is None else TuneConfig(prompts=prompts)
        run_tune(checkpoint or DEMO_CHECKPOINT, tune_config, threads)
        return
    config = PRESETS[preset] if prompts is None else replace(PRESETS[preset], prompts=prompts)
    run(checkpoint or DEMO_CHECKPOINT, config, out, threads)


if __name__ == "__main__":
    app()

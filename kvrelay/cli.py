"""The `kvrelay` command line. Each subcommand imports its stage lazily so that
`kvrelay --help` stays fast and a missing optional dependency only affects its command.

    kvrelay/cli.py          the app; the stack, client, policy and model commands
    kvrelay/serve.py        `kvrelay serve …` (one process per service)
    kvrelay/tools.py        `kvrelay eval …`, `kvrelay bench …`
    kvrelay/checkpoints.py  which checkpoint is served when none is named
"""

from __future__ import annotations

from pathlib import Path

import typer

from kvrelay.checkpoints import DEFAULT_MODEL_HELP, served_checkpoint
from kvrelay.security_options import API_KEY, TLS_CA, TLS_CERT, TLS_KEY, client_security
from kvrelay.serve import serve_app
from kvrelay.tools import bench_app, eval_app

app = typer.Typer(add_completion=False, no_args_is_help=True, help="kvrelay: disaggregated LLM serving with versioned KV-cache policies.")
app.add_typer(serve_app, name="serve")
app.add_typer(bench_app, name="bench")
app.add_typer(eval_app, name="eval")


@app.command()
def demo(
    core: bool = typer.Option(False, "--core", help="Only the policy core on a synthetic prompt (no model, no services)."),
    checkpoint: Path | None = typer.Option(None, help=f"Checkpoint to serve: a .gguf file or an HF directory ({DEFAULT_MODEL_HELP})."),
    context_tokens: int = typer.Option(3000, help="Tokens of real text (the Python language reference) around the needle."),
) -> None:
    """Start the local stack, ask one question hidden in a long text under full, snapkv and snapkv-recall; print answers, TTFT/TPOT and the byte ledger."""
    if core:
        from services.demo.policy_demo import run_demo

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
    from services.demo.policy_demo import run_demo

    run_demo()


@app.command()
def up(
    checkpoint: Path | None = typer.Option(None, envvar="KVRELAY_CHECKPOINT", help=f"Checkpoint to serve: a .gguf file or an HF directory ({DEFAULT_MODEL_HELP})."),
    dtype: str | None = typer.Option(None, envvar="KVRELAY_DTYPE", help="Workers' dtype (default: the checkpoint's)."),
    prefill: int = typer.Option(1, help="Prefill workers (ports 50062, 50072, ...)."),
    decode: int = typer.Option(1, help="Decode workers (ports 50063/50064, 50073/50074, ...)."),
    policy_replicas: int = typer.Option(1, min=1, help="Policy-service processes (ports 50061, 50071, ...); 2 or more share one redis-server the launcher runs (or REDIS_URL), round robin from the gateway and workers."),
    threads: int = typer.Option(1, help="torch threads per service."),
    redis_url: str | None = typer.Option(None, envvar="REDIS_URL", help="Use this Redis instead of an embedded one."),
    log_dir: Path | None = typer.Option(None, help="Service logs (default: a new temporary directory)."),
    base_port: int = typer.Option(50051, help="Gateway port; policy +10 (its framed sessions +14), prefill +11, decode +12 (rendezvous +13), extra workers and policy replicas +10 each."),
    policy_sessions: bool = typer.Option(True, help="The per-request policy calls (begin, publish, fence, end) on the policy service's framed sessions (base port +14), not gRPC: same TLS and tokens, a fraction of the cost."),
    metrics_base_port: int = typer.Option(9091, help="Gateway /metrics port; policy +1, prefill +2, decode +3, extra workers and policy replicas +10 each (0: metrics off)."),
    http_port: int | None = typer.Option(None, help="The gateway's OpenAI-compatible HTTP API (default: base port + 1; 0: off)."),
    tls: bool = typer.Option(False, "--tls", help="Mutual TLS between every service, with a development CA and certificates (`kvrelay certs`) in --tls-dir."),
    tls_dir: Path | None = typer.Option(None, help="With --tls: certificates from `kvrelay certs` (made here if there is no ca.pem; default: a new temporary directory)."),
) -> None:
    """Run a full local deployment on this machine: policy service (+ embedded Redis), prefill, decode, gateway."""
    import tempfile

    from services.launcher.stack import StackConfig
    from services.launcher.up import run_up

    if tls_dir is not None and not tls:
        typer.echo("kvrelay up: --tls-dir: needs --tls", err=True)
        raise typer.Exit(2)
    certs = (tls_dir or Path(tempfile.mkdtemp(prefix="kvrelay-certs-"))) if tls else None
    config = StackConfig.with_counts(
        served_checkpoint(checkpoint), prefill=prefill, decode=decode, policy_replicas=policy_replicas,
        policy_sessions=policy_sessions, base_port=base_port, dtype=dtype,
        threads=threads, redis_url=redis_url, log_dir=log_dir, metrics_base_port=metrics_base_port,
        **({} if http_port is None else {"http_port": http_port}),
        tls_dir=certs,
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
    tls_ca: Path | None = TLS_CA,
    tls_cert: Path | None = TLS_CERT,
    tls_key: Path | None = TLS_KEY,
    api_key: str = API_KEY,
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
        security = client_security("generate", cert=tls_cert, key=tls_key, ca=tls_ca)
        with GatewayClient(gateway, timeout_s=timeout_s, security=security, api_key=api_key) as client:
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
    tls_ca: Path | None = TLS_CA,
    tls_cert: Path | None = TLS_CERT,
    tls_key: Path | None = TLS_KEY,
    api_key: str = API_KEY,
) -> None:
    """Chat with the served model: reads turns from stdin, streams each reply; /reset, /exit."""
    from rich.console import Console

    from services.gateway.client import ChatHistory, GatewayClient, generate_request
    from services.gateway.console import chat_loop
    from services.rpc.kvrelay.v1 import gateway_pb2

    def make_request(messages: gateway_pb2.ChatMessages) -> gateway_pb2.GenerateRequest:
        return generate_request(messages, policy=policy, max_tokens=max_tokens, temperature=temperature,
                                top_k=top_k, top_p=top_p, seed=seed)

    security = client_security("chat", cert=tls_cert, key=tls_key, ca=tls_ca)
    with GatewayClient(gateway, timeout_s=timeout_s, security=security, api_key=api_key) as client:
        chat_loop(client, ChatHistory(system), make_request, Console(), summary=summary)


@app.command()
def policies(
    policy_address: str = typer.Option("127.0.0.1:50061", envvar="KVRELAY_POLICY_ADDRESS", help="host:port of the policy service."),
    register: list[Path] = typer.Option([], help="Register this manifest JSON file first (repeatable)."),
    tls_ca: Path | None = TLS_CA,
    tls_cert: Path | None = TLS_CERT,
    tls_key: Path | None = TLS_KEY,
) -> None:
    """List the registered KV visibility policies (optionally registering manifest files first)."""
    import asyncio
    import os

    from rich.console import Console
    from rich.markup import escape

    from services.gateway.console import policies_table, registered_policies
    from services.policy import PolicyError

    for path in register:  # before anything is registered: all files, or none
        if not path.is_file() or not os.access(path, os.R_OK):
            problem = "no such file" if not path.exists() else "not a readable file"
            typer.echo(f"kvrelay policies: --register {path}: {problem}", err=True)
            raise typer.Exit(2)
    console = Console()
    try:
        security = client_security("policies", cert=tls_cert, key=tls_key, ca=tls_ca)
        manifests = asyncio.run(registered_policies(policy_address, register, security=security))
    except PolicyError as exc:
        console.print(f"[red]{type(exc).__name__}[/red]: {escape(str(exc))}")
        raise typer.Exit(1) from None
    console.print(policies_table(manifests))


@app.command()
def certs(
    directory: Path = typer.Option(Path("kvrelay-certs"), "--dir", envvar="KVRELAY_CERTS_DIR", help="Where the CA and certificates go."),
    name: str | None = typer.Option(None, help="Issue one more identity from the existing CA (default: a new CA and the development set)."),
    role: list[str] = typer.Option([], help="With --name: a role it holds (repeatable): gateway, prefill, decode, policy, operator, client."),
    host: list[str] = typer.Option([], help="A DNS name or IP address to add to the certificates (repeatable)."),
    days: int = typer.Option(30, help="Validity in days."),
    force: bool = typer.Option(False, "--force", help="Replace an existing CA (without --name) or the named certificate."),
) -> None:
    """Create a development CA and per-role certificates (mTLS between kvrelay services)."""
    from rich.console import Console

    from services.security.certs import (
        LOOPBACK_HOSTS,
        CertificateError,
        IdentitySpec,
        check_name,
        default_bundle,
        parse_role,
        write_bundle,
    )

    try:
        if name is None:
            if role:
                raise CertificateError("role", "needs --name (the identity that holds it)")
            bundle = default_bundle(directory, host, days, force=force)
        else:
            if not role:
                raise CertificateError("role", "--name needs at least one --role")
            spec = IdentitySpec(check_name(name), frozenset(parse_role(r) for r in role),
                                (*LOOPBACK_HOSTS, *host))
            bundle = write_bundle(directory, [spec], days, reuse_ca=True, force=force)
    except CertificateError as exc:
        typer.echo(f"kvrelay certs: {exc}", err=True)
        raise typer.Exit(2) from None
    console = Console()
    console.print(f"CA ({'created' if bundle.ca_created else 'reused'}): {bundle.ca_cert}")
    for leaf, cert_path, key_path in bundle.leaves:
        console.print(f"  {leaf:<10} {cert_path}  {key_path}")


@app.command()
def token(
    name: str = typer.Option(..., help="Who the token identifies (owns the request ids it begins)."),
    role: list[str] = typer.Option(["client"], help="A role it holds (repeatable); client: an API key for Generate."),
) -> None:
    """Print a new bearer token (or API key) and the line that makes a server accept it (--auth-tokens)."""
    from services.security.roles import Role
    from services.security.tokens import TokenFileError, new_token

    try:
        roles = frozenset(Role(r) for r in role)
        secret, line = new_token(name, roles)
    except ValueError as exc:
        detail = str(exc) if isinstance(exc, TokenFileError) else f"role: one of {', '.join(r.value for r in Role)}"
        typer.echo(f"kvrelay token: {detail}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"token: {secret}")
    typer.echo(f"--auth-tokens line: {line}")


@app.command("train-demo")
def train_demo(
    out: Path | None = typer.Option(None, help="Output directory (default: the bundled services/model/demo_checkpoint)."),
    seed: int = typer.Option(0, help="Seed of initialization and of the training documents."),
    threads: int = typer.Option(1, help="torch CPU threads."),
    log_file: Path | None = typer.Option(None, help="Also append progress lines to this file."),
    work_dir: Path | None = typer.Option(None, help="Write a snapshot here at every evaluation."),
) -> None:
    """Train the bundled demo checkpoint on the synthetic needle language (CPU, about an hour)."""
    from services.demo.train import TrainConfig, tee_log, train
    from services.model.default import DEMO_CHECKPOINT

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
    from services.demo.evaluate import EvalConfig, run
    from services.model.default import DEMO_CHECKPOINT

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


@app.command("build-kernels")
def build_kernels(
    out_dir: Path = typer.Argument(..., help="Folder to write the kernels and their manifest into (created)."),
    levels: str | None = typer.Option(None, help="Comma-separated CPU levels (default: every level of this machine: x86-64-v4, x86-64-v3, x86-64; elsewhere baseline)."),
) -> None:
    """Build the codes-ranking kernel ahead for each CPU level, for a decode worker without a compiler (KVRELAY_CODES_KERNELS)."""
    from services.offload import codes_kernel

    try:
        written = codes_kernel.prebuild(out_dir, levels.split(",") if levels else None)
    except (ValueError, RuntimeError) as exc:
        typer.echo(f"kvrelay build-kernels: {exc}", err=True)
        raise typer.Exit(1) from None
    for path in written:
        typer.echo(f"wrote {path}")


@app.command()
def codegen(check: bool = typer.Option(False, help="Only verify that the committed stubs are current.")) -> None:
    """Regenerate services/rpc/kvrelay/v1 from proto/ (the only schema)."""
    from services.rpc.codegen import main

    raise typer.Exit(main(["--check"] if check else []))


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


if __name__ == "__main__":
    app()

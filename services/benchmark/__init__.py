"""`kvrelay bench`: kvrelay measured side by side with transformers and kvpress (issue 8).

    config = resolve("smoke", Overrides(contexts="256,512"))   # or preset("full")
    report = run_bench(config, Path("bench-out"))               # services.benchmark.harness

Modules, one per stage: `config` (presets, CLI overrides), `models` (checkpoints and their
sizes), `memory` (peak-RSS probe, estimates), `worker` (the measurement processes),
`transformers_runner` (transformers, and kvpress via `kvpress_runner`) and `kvrelay_runner`
(prefill worker stages, DecodeCache), `bandwidth`, `goals` (pure verdicts), `report` and
`plots` (bench.json, bench.md, PNG); `harness` runs them in that order.
"""

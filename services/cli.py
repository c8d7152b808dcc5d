"""The `kvrelay` command line. Each subcommand imports its stage lazily so that
`kvrelay --help` stays fast and a missing optional dependency only affects its command."""

from __future__ import annotations

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="kvrelay: disaggregated LLM serving with versioned KV-cache policies.")


@app.command()
def demo() -> None:
    """Build a manifest, run SnapKV + allocation on a synthetic prompt, print retained rows and the byte ledger."""
    from services.kvpolicy.demo import run_demo

    run_demo()


if __name__ == "__main__":
    app()

"""Which checkpoint a command serves when none is named (shared by every subcommand)."""

from __future__ import annotations

from pathlib import Path

import typer

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

"""`python -m kvrelay`."""

from kvrelay.cli import app

app()

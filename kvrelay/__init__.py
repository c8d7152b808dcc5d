"""The `kvrelay` command line (`kvrelay.cli:app`). It imports every package and nothing imports
it (tests/test_layering.py)."""

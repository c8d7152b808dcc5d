"""The `kvrelay` command line (`kvrelay.cli:app`). It imports every package and nothing imports
it (tests/test_layering.py)."""

import os

# Every kvrelay process (servers, benchmarks, evaluations) backs torch's large CPU tensors (2 MB
# and up) with transparent huge pages: PyTorch's own switch, read at its first such allocation.
# Gathering a fresh packed view then takes half the time (the page faults of new memory
# dominated it: 393,216 rows of a 16K prompt, 24 layers x 4 heads, in 33 -> 17 ms on one core).
# An operator's own setting wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

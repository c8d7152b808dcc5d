"""k8s/: every overlay renders with a real `kustomize build` and every rendered object validates
(strict: unknown fields fail) against the Kubernetes JSON schemas of the oldest release with
GA gRPC probes and of the newest bundled one; the manifests agree with the `kvrelay` CLI
(environment names, ports) and with themselves (selectors, names, references, images)."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from typing import Any

import pytest
from deploy_helpers import (
    OVERLAYS,
    default_ports,
    envvars,
    is_library_env,
    package_version,
    render,
    resolve_command,
    role_of,
    serve_roles,
)
from kubernetes_validate.utils import ValidationError, latest_version, validate

K8S_VERSIONS = ("1.27", latest_version())  # gRPC probes are GA from 1.27
EXPECTED_KINDS = {"Namespace", "ConfigMap", "Secret", "Service", "Deployment", "StatefulSet",
                  "HorizontalPodAutoscaler", "PodDisruptionBudget"}
MANIFESTS_DIR = "/etc/kvrelay/manifests"
Obj = dict[str, Any]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    return {overlay.name: render(overlay) for overlay in OVERLAYS}


def named(objects: list[Obj], kind: str) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def workloads(objects: list[Obj]) -> list[Obj]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def containers(pod: Obj) -> list[Obj]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def kvrelay_containers(objects: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    """(workload, container) for every container that runs the kvrelay image."""
    for workload in workloads(objects):
        for container in containers(workload["spec"]["template"]["spec"]):
            if container["image"].split(":")[0] == "kvrelay":
                yield workload, container


def role_container(objects: list[Obj], role: str) -> tuple[Obj, Obj]:
    found = [(w, c) for w, c in kvrelay_containers(objects) if role_of(c.get("args", [])) == role]
    assert len(found) == 1, f"{len(found)} containers run `serve {role}`"
    return found[0]


def env_values(container: Obj) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def config_map_env(objects: list[Obj], container: Obj) -> dict[str, str]:
    maps = named(objects, "ConfigMap")
    merged: dict[str, str] = {}
    for source in container.get("envFrom", []):
        merged.update(maps[source["configMapRef"]["name"]]["data"])
    return merged


def selects(selector: dict[str, str], workload: Obj) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in selector.items())


def only_workload(objects: list[Obj], selector: dict[str, str]) -> Obj:
    matches = [w for w in workloads(objects) if selects(selector, w)]
    assert len(matches) == 1, f"selector {selector} matches {[m['metadata']['name'] for m in matches]}"
    return matches[0]


def container_port(workload: Obj, name_or_number: str | int) -> int:
    ports = [p for c in workload["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])]
    if isinstance(name_or_number, int):
        assert name_or_number in [p["containerPort"] for p in ports]
        return name_or_number
    return next(p["containerPort"] for p in ports if p.get("name") == name_or_number)


def service_target(objects: list[Obj], host: str, port: int) -> tuple[Obj, Obj, int]:
    """The Service called `host`, the workload it selects and the container port behind `port`."""
    service = named(objects, "Service").get(host)
    assert service, f"no Service {host}"
    spec_port = next((p for p in service["spec"]["ports"] if p["port"] == port), None)
    assert spec_port, f"Service {host} has no port {port}"
    workload = only_workload(objects, service["spec"]["selector"])
    return service, workload, container_port(workload, spec_port.get("targetPort", port))


def host_port(address: str) -> tuple[str, int]:
    host, _, port = re.sub(r"^\w+://+", "", address).rpartition(":")
    return host, int(port.split("/")[0])


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", [o.name for o in OVERLAYS])
def test_overlay_renders_and_validates_against_kubernetes_schemas(rendered, overlay: str, version: str) -> None:
    objects = rendered[overlay]
    assert {o["kind"] for o in objects} == EXPECTED_KINDS
    for obj in objects:
        try:
            validate(obj, version, strict=True)
        except ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{overlay}: {obj['kind']}/{obj['metadata']['name']} @ {path}: {exc.message} (k8s {version})")


def test_schema_validation_rejects_broken_objects(rendered) -> None:
    deployment = named(rendered["cpu"], "Deployment")["kvrelay-gateway"]
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"grpc": {"port": 50051}}
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "50051"
    for broken in (typo, wrong_type):
        with pytest.raises(ValidationError):
            validate(broken, latest_version(), strict=True)


@pytest.mark.parametrize("overlay", [o.name for o in OVERLAYS])
def test_every_container_uses_only_its_commands_environment_names(rendered, overlay: str) -> None:
    objects = rendered[overlay]
    for workload, container in kvrelay_containers(objects):
        command, rest = resolve_command(container["args"])
        command.make_context(command.name, rest)
        own = envvars(command)
        env = container.get("env", [])
        referenced = {m for e in env for m in re.findall(r"\$\((\w+)\)", e.get("value", ""))}
        where = f"{overlay}: {workload['metadata']['name']}/{container['name']}"
        for position, entry in enumerate(env):
            name = entry["name"]
            assert name in own or is_library_env(name) or name in referenced, (
                f"{where}: {name} is not a variable of `kvrelay {' '.join(container['args'])}`"
            )
            for later in env[position + 1 :]:  # $(NAME) expands only names defined earlier
                assert f"$({later['name']})" not in entry.get("value", ""), f"{where}: {name} uses a later variable"


@pytest.mark.parametrize("overlay", [o.name for o in OVERLAYS])
def test_roles_listen_on_the_cli_default_ports_everywhere(rendered, overlay: str) -> None:
    objects = rendered[overlay]
    for role, ports in default_ports().items():
        workload, container = role_container(objects, role)
        own = {param.name: name for name, param in envvars(serve_roles()[role]).items()}
        values = env_values(container)
        assert values[own["host"]] == "0.0.0.0"
        for param, default in ports.items():
            assert int(values[own[param]]) == default, f"{role}: {own[param]}"
        declared = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert declared["grpc"] == ports["port"]
        if "transfer_port" in ports:
            assert declared["transfer"] == ports["transfer_port"]
        assert declared["metrics"] == ports["metrics_port"]
        assert set(declared.values()) == set(ports.values())
        annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true", f"{role}: pods are not scraped"
        assert annotations.get("prometheus.io/port") == str(ports["metrics_port"]), f"{role}: scrape port"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == ports["port"], f"{role}: {probe} is not a gRPC probe of its port"
        assert values["OTEL_SERVICE_NAME"] == f"kvrelay-{role}"


@pytest.mark.parametrize("overlay", [o.name for o in OVERLAYS])
def test_settings_are_all_consumed_and_addresses_reach_the_right_role(rendered, overlay: str) -> None:
    objects = rendered[overlay]
    readers: dict[str, set[str]] = {}
    for _, container in kvrelay_containers(objects):
        command, _ = resolve_command(container["args"])
        for source in container.get("envFrom", []):
            readers.setdefault(source["configMapRef"]["name"], set()).update(envvars(command))
    for map_name, known in readers.items():
        data = named(objects, "ConfigMap")[map_name]["data"]
        unused = {key for key in data if key not in known and not is_library_env(key)}
        assert not unused, f"{map_name}: no container reading it knows {sorted(unused)}"
    _, gateway = role_container(objects, "gateway")
    settings = config_map_env(objects, gateway)
    for var, role in (("KVRELAY_POLICY_ADDRESS", "policy"), ("KVRELAY_PREFILL_WORKERS", "prefill"),
                      ("KVRELAY_DECODE_WORKERS", "decode")):
        service, workload, port = service_target(objects, *host_port(settings[var]))
        assert workload is role_container(objects, role)[0], f"{var} reaches {workload['metadata']['name']}"
        assert port == default_ports()[role]["port"]
        if role != "policy":
            assert settings[var].startswith("dns:///"), f"{var}: the gateway discovers worker pods by DNS"
            assert service["spec"]["clusterIP"] == "None", f"{service['metadata']['name']} must be headless"
    _, _, transfer = service_target(objects, "kvrelay-decode", default_ports()["decode"]["transfer_port"])
    assert transfer == default_ports()["decode"]["transfer_port"]
    _, jaeger, otlp = service_target(objects, *host_port(settings["OTEL_EXPORTER_OTLP_ENDPOINT"]))
    assert jaeger["metadata"]["name"] == "kvrelay-jaeger" and otlp == 4317


@pytest.mark.parametrize("overlay", [o.name for o in OVERLAYS])
def test_services_budgets_and_autoscaler_select_real_workloads(rendered, overlay: str) -> None:
    objects = rendered[overlay]
    for service in named(objects, "Service").values():
        workload = only_workload(objects, service["spec"]["selector"])
        for port in service["spec"]["ports"]:
            container_port(workload, port.get("targetPort", port["port"]))
    budgets = named(objects, "PodDisruptionBudget")
    for role in serve_roles():
        workload, _ = role_container(objects, role)
        covering = [b for b in budgets.values() if selects(b["spec"]["selector"]["matchLabels"], workload)]
        assert len(covering) == 1, f"{role}: {len(covering)} PodDisruptionBudgets"
    (hpa,) = named(objects, "HorizontalPodAutoscaler").values()
    target = named(objects, hpa["spec"]["scaleTargetRef"]["kind"])[hpa["spec"]["scaleTargetRef"]["name"]]
    assert target is role_container(objects, "decode")[0]
    assert "replicas" not in target["spec"], "the autoscaler owns the decode replica count"
    assert hpa["spec"]["minReplicas"] >= 2 and hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
    decode_budget = next(b for b in budgets.values() if selects(b["spec"]["selector"]["matchLabels"], target))
    assert decode_budget["spec"]["minAvailable"] < hpa["spec"]["minReplicas"], "a drain can always proceed"


@pytest.mark.parametrize("overlay", [o.name for o in OVERLAYS])
def test_references_to_config_maps_secrets_and_volumes_resolve(rendered, overlay: str) -> None:
    objects = rendered[overlay]
    maps, secrets = named(objects, "ConfigMap"), named(objects, "Secret")
    for workload in workloads(objects):
        pod = workload["spec"]["template"]["spec"]
        claims = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for volume in volumes.values():
            if "configMap" in volume:
                assert volume["configMap"]["name"] in maps
        for container in containers(pod):
            for source in container.get("envFrom", []):
                assert source["configMapRef"]["name"] in maps
            for entry in container.get("env", []):
                ref = entry.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]]["data"], f"{ref} is not in a rendered Secret"
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes or mount["name"] in claims, f"{container['name']}: {mount['name']}"


@pytest.mark.parametrize("overlay", [o.name for o in OVERLAYS])
def test_pods_run_as_non_root_with_requests_and_limits(rendered, overlay: str) -> None:
    for workload in workloads(rendered[overlay]):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, workload["metadata"]["name"]
        assert pod["securityContext"]["runAsUser"] != 0
        for container in containers(pod):
            where = f"{workload['metadata']['name']}/{container['name']}"
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, where
            assert container["securityContext"]["capabilities"]["drop"] == ["ALL"], where
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][bound]), f"{where}: {bound}"


@pytest.mark.parametrize("overlay", [o.name for o in OVERLAYS])
def test_images_are_pinned_and_match_the_overlay(rendered, overlay: str) -> None:
    objects = rendered[overlay]
    version = package_version()
    gpu_roles = {"prefill", "decode"} if overlay == "gpu" else set()
    for workload in workloads(objects):
        for container in containers(workload["spec"]["template"]["spec"]):
            assert re.search(r":\d+\.\d+\.\d+", container["image"]), f"{container['image']} is not pinned"
    for _, container in kvrelay_containers(objects):
        role = role_of(container["args"])
        flavor = "cuda" if role in gpu_roles else "cpu"
        assert container["image"] == f"kvrelay:{version}-{flavor}", f"{overlay}: {container['name']}"
        gpus = container["resources"]["limits"].get("nvidia.com/gpu")
        assert gpus == ("1" if flavor == "cuda" else None), f"{overlay}: {container['name']} GPUs {gpus}"


def test_gpu_overlay_places_workers_on_gpu_nodes_with_nccl(rendered) -> None:
    objects = rendered["gpu"]
    for role in ("prefill", "decode"):
        workload, container = role_container(objects, role)
        pod = workload["spec"]["template"]["spec"]
        values = env_values(container)
        assert values["KVRELAY_DEVICE"] == "cuda" and "KVRELAY_DEVICE" in envvars(serve_roles()[role])
        assert values["NCCL_SOCKET_IFNAME"] == "eth0"
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        shm = next(m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
        assert next(v for v in pod["volumes"] if v["name"] == shm)["emptyDir"]["medium"] == "Memory"
        assert container["readinessProbe"]["grpc"]["port"] == default_ports()[role]["port"], "the patch kept the probes"
    cpu_workers = [role_container(rendered["cpu"], role)[1] for role in ("prefill", "decode")]
    assert all("KVRELAY_DEVICE" not in env_values(c) for c in cpu_workers)


def test_redis_password_comes_from_one_secret_and_data_persists(rendered) -> None:
    objects = rendered["cpu"]
    (redis,) = named(objects, "StatefulSet").values()
    redis_container = redis["spec"]["template"]["spec"]["containers"][0]
    _, policy = role_container(objects, "policy")
    secret_refs = [
        e["valueFrom"]["secretKeyRef"] for c in (redis_container, policy) for e in c["env"]
        if e["name"] == "REDIS_PASSWORD"
    ]
    assert len(secret_refs) == 2 and secret_refs[0] == secret_refs[1]
    assert redis_container["args"][redis_container["args"].index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    url = env_values(policy)["REDIS_URL"]
    assert url.startswith("redis://:$(REDIS_PASSWORD)@")
    assert "REDIS_URL" in envvars(serve_roles()["policy"])
    _, workload, port = service_target(objects, *host_port(url.split("@", 1)[1]))
    assert workload is redis and port == 6379
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": "/data"} in redis_container["volumeMounts"]


def test_manifests_config_map_is_registered_and_fits_the_default_model(rendered) -> None:
    from services.gateway.policies import served_manifests
    from services.kvpolicy.fit import Deployment, check_fits
    from services.kvpolicy.manifest import KVVisibilityPolicyManifest
    from services.model.config import make_tensor_contract, resolve_dtype
    from services.model.default import default_checkpoint
    from services.model.loader import read_checkpoint

    objects = rendered["cpu"]
    workload, _ = role_container(objects, "gateway")
    pod = workload["spec"]["template"]["spec"]
    (register,) = [c for c in pod["initContainers"] if c["args"][0] == "policies"]
    registered = {register["args"][i + 1] for i, a in enumerate(register["args"]) if a == "--register"}
    mount = next(m for m in register["volumeMounts"] if m["mountPath"] == MANIFESTS_DIR)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    files = named(objects, "ConfigMap")[volume["configMap"]["name"]]["data"]
    assert registered == {f"{MANIFESTS_DIR}/{name}" for name in files}
    # The images serve the default model (no KVRELAY_CHECKPOINT in the base): the extra
    # manifests must fit its tensor contract.
    for _, container in kvrelay_containers(objects):
        assert "KVRELAY_CHECKPOINT" not in env_values(container) | config_map_env(objects, container)
    model = read_checkpoint(default_checkpoint()).config
    served = make_tensor_contract(model, resolve_dtype(None, model.checkpoint_dtype))
    for name, text in files.items():
        manifest = KVVisibilityPolicyManifest.from_json(text)
        assert name == f"{manifest.name}.json"
        assert manifest.name not in served_manifests(served), "the gateway registers the defaults itself"
        check_fits(manifest, Deployment(served))  # ManifestUnfit names the field that does not fit

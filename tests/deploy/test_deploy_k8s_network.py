"""k8s/base/networkpolicy.yaml: the namespace denies everything by default, and the edges its
NetworkPolicies allow, derived from the rendered objects on both ends (the source's egress and
the destination's ingress), are exactly the design's edges (DESIGN.md §2, docs/architecture.md):
no edge the request path needs is missing and none it does not need is open."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from deploy_helpers import (
    GATEWAY_HTTP_PORT,
    K8S_SECRETS_SCRIPT,
    OVERLAYS,
    POLICY_SESSION_PORT,
    REPO,
    copy_with_secrets,
    default_ports,
    render,
)

Obj = dict[str, Any]
Edge = tuple[str, str, str]  # (source, destination, "TCP/port" or "TCP/first-last")
# Peers outside the namespace's pods: any client, the monitoring namespace, cluster DNS, the
# external Redis Cluster's namespace (overlays with components/redis-cluster).
CLIENTS, MONITORING, DNS, REDIS_CLUSTER = "clients", "monitoring", "kube-dns", "redis-cluster"
COMPONENT = "app.kubernetes.io/component"
KVRELAY_ROLES = ("gateway", "policy", "prefill", "decode")
PAIR_SYSCTL = "net.ipv4.ip_local_port_range"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Obj]]:
    tree = copy_with_secrets(REPO / "k8s", tmp_path_factory.mktemp("net") / "k8s",
                             K8S_SECRETS_SCRIPT.name, "secrets")
    return {o.name: render(Path(tree) / "overlays" / o.name) for o in OVERLAYS}


def pods(objects: list[Obj]) -> dict[str, dict[str, str]]:
    """component -> the pod template's labels, for every workload."""
    found = {}
    for workload in objects:
        if workload["kind"] in ("Deployment", "StatefulSet"):
            labels = workload["spec"]["template"]["metadata"]["labels"]
            found[labels[COMPONENT]] = labels
    return found


def pod_template(objects: list[Obj], component: str) -> Obj:
    return next(o["spec"]["template"]["spec"] for o in objects if o["kind"] in ("Deployment", "StatefulSet")
                and o["spec"]["template"]["metadata"]["labels"][COMPONENT] == component)


def selected(selector: Obj, components: dict[str, dict[str, str]]) -> set[str]:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels selectors are understood: {selector}"
    wanted = selector.get("matchLabels", {})
    return {c for c, labels in components.items() if all(labels.get(k) == v for k, v in wanted.items())}


def peers(rule_peers: list[Obj] | None, components: dict[str, dict[str, str]]) -> set[str]:
    """The named peers of one rule's `from`/`to` (absent: any source, i.e. clients)."""
    if rule_peers is None:
        return {CLIENTS}
    found: set[str] = set()
    for peer in rule_peers:
        assert "ipBlock" not in peer, f"no ipBlock is expected: {peer}"
        namespace = peer.get("namespaceSelector")
        if namespace is None:
            found |= selected(peer["podSelector"], components)
        elif namespace == {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}:
            assert "podSelector" not in peer, "any pod of the monitoring namespace scrapes"
            found.add(MONITORING)
        elif namespace == {"matchLabels": {"kubernetes.io/metadata.name": "redis"}}:
            assert "podSelector" not in peer, "any node of the external Redis Cluster"
            found.add(REDIS_CLUSTER)
        elif namespace == {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}:
            assert peer["podSelector"] == {"matchLabels": {"k8s-app": "kube-dns"}}, peer
            found.add(DNS)
        else:
            raise AssertionError(f"unexpected namespace peer {peer}")
    return found


def ports(rule_ports: list[Obj] | None) -> set[str]:
    if rule_ports is None:
        return {"any"}
    found = set()
    for port in rule_ports:
        assert isinstance(port["port"], int), "numbers, checked against the CLI's defaults"
        end = port.get("endPort")
        found.add(f"{port.get('protocol', 'TCP')}/{port['port']}" + (f"-{end}" if end else ""))
    return found


def allowed(objects: list[Obj]) -> tuple[set[Edge], set[Edge]]:
    """(edges the destinations' ingress rules admit, edges the sources' egress rules admit)."""
    components = pods(objects)
    ingress: set[Edge] = set()
    egress: set[Edge] = set()
    for policy in (o for o in objects if o["kind"] == "NetworkPolicy"):
        spec = policy["spec"]
        own = selected(spec["podSelector"], components)
        for rule in spec.get("ingress", []):
            ingress |= {(s, d, p) for s in peers(rule.get("from"), components) for d in own
                        for p in ports(rule.get("ports"))}
        for rule in spec.get("egress", []):
            egress |= {(s, d, p) for s in own for d in peers(rule.get("to"), components)
                       for p in ports(rule.get("ports"))}
    return ingress, egress


def design_edges(pair_range: str, redis_cluster: bool = False) -> set[Edge]:
    """The edges one request needs, with the ports of `kvrelay serve ROLE`'s defaults; with
    `redis_cluster`, the policy service's Redis is the external cluster, not a pod here."""
    port = {role: ports_["port"] for role, ports_ in default_ports().items()}
    tcp = "TCP/{}".format
    pair = f"TCP/{pair_range}"
    edges = {
        (CLIENTS, "gateway", tcp(port["gateway"])),
        (CLIENTS, "gateway", tcp(GATEWAY_HTTP_PORT)),  # the OpenAI-compatible HTTP API
        *(("gateway", role, tcp(port[role])) for role in ("policy", "prefill", "decode")),
        ("prefill", "policy", tcp(port["policy"])),
        ("prefill", "decode", tcp(port["decode"])),
        ("prefill", "decode", tcp(default_ports()["decode"]["transfer_port"])),  # rendezvous
        ("prefill", "decode", pair),
        ("decode", "policy", tcp(port["policy"])),
        ("decode", "prefill", tcp(port["prefill"])),  # OffloadService: Recall, RenewLease, Release
        ("decode", "prefill", pair),
        ("policy", REDIS_CLUSTER if redis_cluster else "redis", "TCP/6379"),
    }
    # Each policy client's per-request calls: the policy service's framed sessions.
    edges |= {(role, "policy", tcp(POLICY_SESSION_PORT)) for role in ("gateway", "prefill", "decode")}
    edges |= {(role, "jaeger", "TCP/4317") for role in KVRELAY_ROLES}
    edges |= {(MONITORING, role, tcp(default_ports()[role]["metrics_port"])) for role in KVRELAY_ROLES}
    own_redis = () if redis_cluster else ("redis",)
    edges |= {(c, DNS, f"{proto}/53") for c in (*KVRELAY_ROLES, *own_redis, "jaeger") for proto in ("UDP", "TCP")}
    return edges


def pair_group_range(objects: list[Obj]) -> str:
    """The ephemeral port range both workers pin (gloo and NCCL listen there)."""
    ranges = set()
    for role in ("prefill", "decode"):
        sysctls = {s["name"]: s["value"] for s in pod_template(objects, role)["securityContext"]["sysctls"]}
        first, last = map(int, sysctls[PAIR_SYSCTL].split())
        ranges.add(f"{first}-{last}")
    assert len(ranges) == 1, f"prefill and decode pin different ranges: {ranges}"
    (found,) = ranges
    first, last = map(int, found.split("-"))
    service_ports = {p for role in default_ports().values() for p in role.values()} | {6379, 4317, POLICY_SESSION_PORT}
    assert not any(first <= p <= last for p in service_ports), "a listening port inside the ephemeral range"
    return found


def compare(objects: list[Obj]) -> list[str]:
    """What differs between the allowed edges and the design's (empty when they agree)."""
    ingress, egress = allowed(objects)
    expected = design_edges(pair_group_range(objects), redis_cluster="redis" not in pods(objects))
    inside = set(pods(objects))
    problems = []
    for side, found, wanted in (
        ("ingress", ingress, {e for e in expected if e[1] in inside}),
        ("egress", egress, {e for e in expected if e[0] in inside}),
    ):
        problems += [f"{side} allows {e}, which the design does not need" for e in sorted(found - wanted)]
        problems += [f"{side} misses {e}, which the design needs" for e in sorted(wanted - found)]
    return problems


@pytest.mark.parametrize("overlay", [o.name for o in OVERLAYS])
def test_allowed_edges_are_exactly_the_designs(rendered, overlay: str) -> None:
    problems = compare(rendered[overlay])
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("overlay", [o.name for o in OVERLAYS])
def test_everything_else_is_denied_by_default(rendered, overlay: str) -> None:
    policies = [o for o in rendered[overlay] if o["kind"] == "NetworkPolicy"]
    deny = [p for p in policies if p["spec"]["podSelector"] == {}
            and set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"}
            and not p["spec"].get("ingress") and not p["spec"].get("egress")]
    assert len(deny) == 1, "one default-deny policy for ingress and egress of every pod"
    assert all(p["metadata"]["namespace"] == "kvrelay" for p in policies)
    # A policy type a policy lists but gives no rule for is denied for its pods.
    for policy in policies:
        for kind in ("Ingress", "Egress"):
            assert kind in policy["spec"]["policyTypes"] or not policy["spec"].get(kind.lower()), policy


def test_the_comparison_catches_an_extra_or_missing_edge(rendered) -> None:
    objects = rendered["cpu"]
    extra = copy.deepcopy(objects)
    redis = next(o for o in extra if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "kvrelay-redis")
    redis["spec"]["ingress"].append({"from": [{"podSelector": {"matchLabels": {COMPONENT: "gateway"}}}],
                                     "ports": [{"protocol": "TCP", "port": 6379}]})
    assert compare(extra) == ["ingress allows ('gateway', 'redis', 'TCP/6379'), which the design does not need"]
    missing = copy.deepcopy(objects)
    decode = next(o for o in missing if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "kvrelay-decode")
    decode["spec"]["egress"] = [r for r in decode["spec"]["egress"]
                                if r["to"][0]["podSelector"]["matchLabels"][COMPONENT] != "prefill"]
    assert set(compare(missing)) == {
        "egress misses ('decode', 'prefill', 'TCP/50062'), which the design needs",
        "egress misses ('decode', 'prefill', 'TCP/40000-49999'), which the design needs",
    }
    open_port = copy.deepcopy(objects)
    gateway = next(o for o in open_port if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "kvrelay-gateway")
    del gateway["spec"]["ingress"][0]["ports"]
    assert "ingress allows ('clients', 'gateway', 'any'), which the design does not need" in compare(open_port)

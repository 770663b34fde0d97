"""The deployment files against their official schemas, offline: every Kubernetes manifest (and
the ConfigMap kustomize generates) against the Kubernetes OpenAPI schemas `kubernetes-validate`
ships, strictly (an unknown field is an error), and docker-compose.yml against the Compose
Specification's schema that `check-jsonschema` vendors. Then what the manifests promise: auth on
with keys from the Secret, a NetworkPolicy for the gateway and for Redis, a PodDisruptionBudget,
probes, and Redis as the shared store."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from importlib import resources
from typing import Any

import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]  # ships no type information
import pytest
import yaml

from gateway.admission.auth import exposed_without_keys
from tests.project.test_deploy import (
    COMPOSE,
    K8S,
    SECRET_NAME,
    container_port,
    gateway_container,
    k8s_config_variables,
    k8s_documents,
    k8s_manifests,
    k8s_object,
    k8s_settings,
    kustomization,
)

# An older Kubernetes minor and the newest the pinned package knows.
K8S_VERSIONS = ("1.33.0", "1.37.0")
SECRET = "tailguard-secrets"


def generated_config_map() -> dict[str, Any]:
    """The ConfigMap `configMapGenerator` makes (its name gets a hash suffix; the schema does
    not care)."""
    [generator] = kustomization()["configMapGenerator"]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": generator["name"]},
        "data": {name: (K8S / name).read_text(encoding="utf-8") for name in generator["files"]},
    }


def every_k8s_document() -> list[dict[str, Any]]:
    return [
        *k8s_manifests(),
        generated_config_map(),
        *k8s_documents(K8S / "secret.example.yaml"),
    ]


def containers() -> list[dict[str, Any]]:
    """Every container of every workload."""
    return [
        container
        for doc in k8s_manifests()
        if doc["kind"] == "Deployment"
        for container in doc["spec"]["template"]["spec"]["containers"]
    ]


def pod_labels(name: str) -> dict[str, str]:
    labels = k8s_object("Deployment", name)["spec"]["template"]["metadata"]["labels"]
    assert isinstance(labels, dict)
    return labels


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels only) selects pods with `labels`."""
    assert set(selector) <= {"matchLabels"}, selector
    return bool(selector["matchLabels"].items() <= labels.items())


# --- the schemas ---------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_k8s_manifests_validate_against_the_kubernetes_schemas(version: str) -> None:
    """Every manifest kustomize applies, the ConfigMap it generates and the Secret's example
    validate strictly against Kubernetes' own schemas."""
    documents = every_k8s_document()
    kinds = sorted(doc["kind"] for doc in documents)
    assert kinds == sorted(
        [
            *("ConfigMap", "Deployment", "Deployment", "HorizontalPodAutoscaler"),
            *("NetworkPolicy", "NetworkPolicy", "PodDisruptionBudget", "Secret"),
            *("Service", "Service"),
        ]
    )
    for doc in documents:
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_kubernetes_validation_rejects_what_is_wrong() -> None:
    """The validation is not vacuous: a misspelt field, a port as a word, a missing selector."""
    deployment = k8s_object("Deployment")
    misspelt = copy.deepcopy(deployment)
    misspelt["spec"]["replica"] = 2
    port = copy.deepcopy(k8s_object("Service"))
    port["spec"]["ports"][0]["port"] = "eighty"
    unselected = copy.deepcopy(deployment)
    del unselected["spec"]["selector"]
    for wrong in (misspelt, port, unselected):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(wrong, K8S_VERSIONS[-1], strict=True)


def compose_schema() -> dict[str, Any]:
    vendored = resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    schema = json.loads(vendored.read_text(encoding="utf-8"))
    assert isinstance(schema, dict)
    return schema


def test_compose_file_validates_against_the_compose_spec() -> None:
    """docker-compose.yml is valid Compose: the check-jsonschema CLI with its vendored
    compose-spec schema says so, and so does the same schema read directly."""
    done = subprocess.run(
        [
            *(sys.executable, "-m", "check_jsonschema"),
            *("--builtin-schema", "vendor.compose-spec", str(COMPOSE)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    document = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    assert list(validator.iter_errors(document)) == []
    # Not vacuous: a misspelt service key and a misspelt healthcheck key are refused.
    for service, where in (("redis", ()), ("prometheus", ("healthcheck",))):
        wrong = copy.deepcopy(document)
        node = wrong["services"][service]
        for key in where:
            node = node[key]
        node["imag" if not where else "intervall"] = "5s"
        assert list(validator.iter_errors(wrong)), (service, where)


def test_compose_does_not_pick_up_the_gateway_config() -> None:
    """Compose reads compose.yaml (and compose.yml, docker-compose.y*ml) from the directory it
    runs in and its parents' project files: the gateway's config is named otherwise."""
    root = COMPOSE.parent
    for name in ("compose.yaml", "compose.yml"):
        assert not (root / name).exists()
        assert not (root / "config" / name).exists()
    assert (root / "config" / "compose-gateway.yaml").is_file()


# --- what the manifests promise ------------------------------------------------------------------


def test_k8s_gateway_runs_with_auth_on_and_keys_from_the_secret() -> None:
    """The gateway's config turns auth on (client and admin keys), serves beyond loopback only
    because it has keys, and takes each key's hash, like every provider key and the Redis URL,
    from the Secret through a secretKeyRef."""
    settings = k8s_settings()
    assert settings.auth is not None and settings.auth.enabled
    assert settings.auth.keys and settings.auth.admin_keys
    assert settings.server.allow_unauthenticated is False
    assert not exposed_without_keys(settings)
    variables = k8s_config_variables()
    assert {"CLIENT_KEY_SHA256", "ADMIN_KEY_SHA256", "REDIS_URL"} <= variables
    secret = k8s_documents(K8S / "secret.example.yaml")[0]
    env = {e["name"]: e for e in gateway_container()["env"]}
    for name in variables:
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == SECRET == secret["metadata"]["name"], name
        assert ref["key"] in secret["stringData"], name


def test_every_secret_in_every_container_comes_from_the_secret() -> None:
    """In the gateway's container and Redis's alike, a variable named like a secret comes from
    a secretKeyRef into the one Secret, never from a literal value."""
    secret = k8s_documents(K8S / "secret.example.yaml")[0]["stringData"]
    seen = 0
    for container in containers():
        for env in container.get("env", []):
            if SECRET_NAME.search(env["name"]) or "PASSWORD" in env["name"]:
                assert "value" not in env, env["name"]
                ref = env["valueFrom"]["secretKeyRef"]
                assert (ref["name"], ref["key"] in secret) == (SECRET, True), env["name"]
                seen += 1
    assert seen >= 6


def test_k8s_redis_is_the_shared_store() -> None:
    """Redis runs as a Deployment behind its Service; the Secret's redis-url points at that
    Service and port; it asks for the password it is given; the gateway's latency store (and
    so its rate limits) use it."""
    redis = k8s_object("Deployment", "tailguard-redis")
    [container] = redis["spec"]["template"]["spec"]["containers"]
    service = k8s_object("Service", "tailguard-redis")
    assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels("tailguard-redis"))
    assert not selects({"matchLabels": service["spec"]["selector"]}, pod_labels("tailguard"))
    [port] = service["spec"]["ports"]
    assert container_port(container, port["targetPort"]) == port["port"] == 6379
    args = [str(a) for a in container["args"]]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert container["readinessProbe"] and container["livenessProbe"]
    secret = k8s_documents(K8S / "secret.example.yaml")[0]["stringData"]
    url = secret["redis-url"]
    assert url.endswith(f"@{service['metadata']['name']}:{port['port']}/0"), url
    settings = k8s_settings()
    assert settings.latency.store == "redis"
    assert settings.auth is not None and settings.auth.rate_limits.store in ("auto", "redis")


def test_k8s_network_policies_fence_the_gateway_and_redis() -> None:
    """The gateway's policy covers its pods both ways: in, only on its HTTP port; out, to Redis
    on Redis's port, DNS, the collector and HTTPS. Redis's admits the gateway's pods alone and
    lets nothing out."""
    gateway = k8s_object("NetworkPolicy")["spec"]
    assert selects(gateway["podSelector"], pod_labels("tailguard"))
    assert sorted(gateway["policyTypes"]) == ["Egress", "Ingress"]
    for rule in gateway["ingress"]:
        assert [container_port(gateway_container(), p["port"]) for p in rule["ports"]] == [8080]
    egress_ports = {p["port"] for rule in gateway["egress"] for p in rule["ports"]}
    assert {53, 443, 4318, 6379} <= egress_ports
    to_redis = [
        rule
        for rule in gateway["egress"]
        if any(
            "podSelector" in peer and selects(peer["podSelector"], pod_labels("tailguard-redis"))
            for peer in rule["to"]
        )
    ]
    assert [[p["port"] for p in rule["ports"]] for rule in to_redis] == [[6379]]

    redis = k8s_object("NetworkPolicy", "tailguard-redis")["spec"]
    assert selects(redis["podSelector"], pod_labels("tailguard-redis"))
    assert sorted(redis["policyTypes"]) == ["Egress", "Ingress"]
    assert redis["egress"] == []
    [rule] = redis["ingress"]
    [peer] = rule["from"]
    assert set(peer) == {"podSelector"}
    assert selects(peer["podSelector"], pod_labels("tailguard"))
    assert not selects(peer["podSelector"], pod_labels("tailguard-redis"))


def test_k8s_disruption_budget_and_probes_keep_the_gateway_serving() -> None:
    """The PodDisruptionBudget covers the gateway's pods and leaves one serving; the gateway is
    probed on /readyz (readiness) and /healthz (liveness)."""
    pdb = k8s_object("PodDisruptionBudget")["spec"]
    assert selects(pdb["selector"], pod_labels("tailguard"))
    replicas = k8s_object("Deployment")["spec"]["replicas"]
    if "maxUnavailable" in pdb:
        assert pdb["maxUnavailable"] < replicas
    else:
        assert 0 < pdb["minAvailable"] < replicas
    container = gateway_container()
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_compose_rename_left_no_reference_behind() -> None:
    """Every file that names the compose stack's gateway config names the new file."""
    root = COMPOSE.parent
    old = "config/" + "compose.yaml"  # spelt in two parts: this file is searched too
    candidates = [*root.glob("*.*"), root / "Makefile", root / "Dockerfile"]
    for folder in ("config", "deploy", "docs", "tests", "gateway", "bench"):
        candidates += (root / folder).rglob("*")
    texts = (".yaml", ".yml", ".md", ".py", ".json", ".toml", "")
    stale = [
        str(path.relative_to(root))
        for path in candidates
        if path.is_file() and path.suffix in texts and old in path.read_text("utf-8", "replace")
    ]
    assert stale == []

"""k8s/: the RayService against KubeRay's CRD schema, its serveConfigV2 against Ray Serve's schema, and
the operator YAML in the ConfigMap against cluster.config, for the base and each rendered overlay."""

import copy
import functools
import importlib
import math
import posixpath
import shutil
import subprocess
import warnings
from pathlib import Path

import jsonschema
import pydantic
import pytest
import yaml

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # Ray's own pydantic-v1-style Field(...) calls
    from ray.serve.schema import ServeDeploySchema

from cluster.config import parse_config, parse_live_config
from cluster.serve_app import GRPC_SERVICER, SpecDecodeIngress

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
CRD = ROOT.parent / "shared" / "kuberay" / "ray.io_rayservices.yaml"
PROFILES = ["base", "overlays/cpu", "overlays/gpu"]


def strict(schema):
    """The CRD schema as the API server applies it: fields a schema does not list are errors (no
    x-kubernetes-preserve-unknown-fields here). Int-or-string nodes already carry their anyOf, and
    the other x-kubernetes-* keys are not checked."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    node = {key: strict(value) for key, value in schema.items()}
    open_ended = "additionalProperties" in node or node.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in node and not open_ended:
        node["additionalProperties"] = False
    return node


@pytest.fixture(scope="module")
def rayservice_validator():
    if not CRD.exists():
        pytest.skip(f"KubeRay's RayService CRD is absent ({CRD})")
    crd = yaml.safe_load(CRD.read_text())
    (v1,) = [version for version in crd["spec"]["versions"] if version["name"] == "v1"]
    return jsonschema.Draft202012Validator(strict(v1["schema"]["openAPIV3Schema"]))


@functools.cache
def _render(profile: str) -> tuple:
    if kubectl := shutil.which("kubectl"):
        command = [kubectl, "kustomize", str(K8S / profile)]
    elif kustomize := shutil.which("kustomize"):
        command = [kustomize, "build", str(K8S / profile)]
    else:
        pytest.skip("neither kubectl nor kustomize is on PATH to render the kustomizations")
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=60).stdout
    return tuple(yaml.safe_load_all(out))


def rendered(profile: str, kind: str) -> list[dict]:
    return [doc for doc in _render(profile) if doc["kind"] == kind]


def rayservice(profile: str) -> dict:
    (service,) = rendered(profile, "RayService")
    return service


def pod_groups(service: dict) -> list[dict]:
    cluster = service["spec"]["rayClusterConfig"]
    return [{"groupName": "head", **cluster["headGroupSpec"]}, *cluster["workerGroupSpecs"]]


def serve_app(service: dict) -> tuple[dict, dict]:
    """serveConfigV2 parsed, and its one application."""
    serve = yaml.safe_load(service["spec"]["serveConfigV2"])
    (app,) = serve["applications"]
    return serve, app


def operator_config(profile: str):
    """The operator YAML at the path serveConfigV2 names, as the ConfigMap mounted there holds it."""
    config_path = serve_app(rayservice(profile))[1]["args"]["config"]
    (configmap,) = rendered(profile, "ConfigMap")
    return parse_config(configmap["data"][posixpath.basename(config_path)], source=f"{profile}: {config_path}")


def resolve(dotted: str, separator: str):
    module, _, name = dotted.rpartition(separator)
    return getattr(importlib.import_module(module), name)


def test_base_files_match_crd(rayservice_validator):
    """Without a renderer too: the RayService as written in k8s/base."""
    resources = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["resources"]
    docs = [doc for name in resources for doc in yaml.safe_load_all((K8S / "base" / name).read_text())]
    services = [doc for doc in docs if doc["kind"] == "RayService"]
    assert services
    for service in services:
        rayservice_validator.validate(service)


@pytest.mark.parametrize("profile", PROFILES)
def test_rayservice_matches_crd(profile, rayservice_validator):
    service = rayservice(profile)
    assert service["apiVersion"] == "ray.io/v1"
    rayservice_validator.validate(service)


@pytest.mark.parametrize("path, value, complaint", [
    (("spec", "rayClusterConfig", "headGroupSpec", "rayStartParam"), {"num-gpus": "0"}, "Additional properties"),
    (("spec", "rayClusterConfig", "workerGroupSpecs", 0, "replicas"), "1", "is not of type 'integer'"),
    (("spec", "rayClusterConfig", "workerGroupSpecs", 0, "template", "spec", "containers", 0, "ports", 0,
      "containerPort"), "8000", "is not of type 'integer'"),
])
def test_crd_check_rejects_a_broken_rayservice(path, value, complaint, rayservice_validator):
    broken = copy.deepcopy(rayservice("base"))
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    errors = list(rayservice_validator.iter_errors(broken))
    assert errors and complaint in errors[0].message


def check_serve_config(serve: dict) -> None:
    parsed = ServeDeploySchema.model_validate(serve)
    # Serve ignores keys it does not know, so a misspelled key would silently drop its setting.
    assert parsed.model_dump(exclude_unset=True) == serve, "serveConfigV2 has keys Ray Serve does not know"


@pytest.mark.parametrize("profile", PROFILES)
def test_serve_config_matches_ray_schema(profile):
    serve, app = serve_app(rayservice(profile))
    check_serve_config(serve)
    assert app["import_path"] == "cluster.serve_app:build_app"
    assert serve["grpc_options"]["grpc_servicer_functions"] == [GRPC_SERVICER]


@pytest.mark.parametrize("key, value", [("grpc_option", {"port": 9000}), ("http_options", {"port": "http"})])
def test_serve_config_check_rejects_a_broken_one(key, value):
    serve, _ = serve_app(rayservice("base"))
    with pytest.raises((AssertionError, pydantic.ValidationError)):
        check_serve_config({**serve, key: value})


@pytest.mark.parametrize("profile", PROFILES)
def test_serve_import_paths_resolve(profile):
    serve, app = serve_app(rayservice(profile))
    for servicer in serve["grpc_options"]["grpc_servicer_functions"]:
        assert callable(resolve(servicer, "."))
    assert callable(resolve(app["import_path"], ":"))


@pytest.mark.parametrize("profile", PROFILES)
def test_ports_agree(profile):
    """Serve's proxy ports, the head container's named ports (the serve Service is built from them)
    and the operator config's server section."""
    service = rayservice(profile)
    serve, _ = serve_app(service)
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]
    head_ports = {port["name"]: port["containerPort"] for port in head["template"]["spec"]["containers"][0]["ports"]}
    server = operator_config(profile).server
    assert head_ports["serve"] == serve["http_options"]["port"] == server.http_port
    assert head_ports["serve-grpc"] == serve["grpc_options"]["port"] == server.grpc_port
    assert head_ports["metrics"] == int(head["rayStartParams"]["metrics-export-port"])


@pytest.mark.parametrize("profile", PROFILES)
def test_operator_config_in_configmap_is_valid(profile):
    config = operator_config(profile)
    assert config.models.target.path.startswith("/models/") and config.models.draft.path.startswith("/models/")


@pytest.mark.parametrize("profile", PROFILES)
def test_configmap_mounted_as_directory_in_every_pod(profile):
    """The operator YAML is where serveConfigV2's args say, in every pod (a directory mount: a
    subPath mount would never see the ConfigMap's updates)."""
    service = rayservice(profile)
    config_path = serve_app(service)[1]["args"]["config"]
    configmaps = {configmap["metadata"]["name"] for configmap in rendered(profile, "ConfigMap")}
    for group in pod_groups(service):
        pod = group["template"]["spec"]
        volumes = {volume["name"]: volume["configMap"]["name"] for volume in pod["volumes"] if "configMap" in volume}
        (container,) = pod["containers"]
        mounts = [mount for mount in container["volumeMounts"] if mount["name"] in volumes]
        assert [(mount["mountPath"], mount.get("subPath")) for mount in mounts] == [
            (posixpath.dirname(config_path), None)], group["groupName"]
        assert volumes[mounts[0]["name"]] in configmaps, group["groupName"]


@pytest.mark.parametrize("profile", PROFILES)
def test_every_pod_runs_ray_workers_at_nice_0_as_specdec_serve_does(profile):
    from cluster.commands import WORKER_NICENESS

    for group in pod_groups(rayservice(profile)):
        (container,) = group["template"]["spec"]["containers"]
        env = {var["name"]: var.get("value") for var in container.get("env", [])}
        assert env.get("RAY_worker_niceness") == WORKER_NICENESS, group["groupName"]


@pytest.mark.parametrize("profile", PROFILES)
def test_routing_is_the_ingress_user_config(profile):
    """Routing lives in one place, serveConfigV2's user_config for the ingress deployment (applied in
    place, live); it is a valid live config and the ConfigMap's YAML does not repeat it."""
    _, app = serve_app(rayservice(profile))
    (deployment,) = app["deployments"]
    assert deployment["name"] == SpecDecodeIngress.name
    routing = parse_live_config(deployment["user_config"], source=f"{profile}: serveConfigV2")
    assert set(routing.task_types) == {"code", "prose"}
    (configmap,) = rendered(profile, "ConfigMap")
    (text,) = configmap["data"].values()
    assert "routing" not in yaml.safe_load(text)


def gpus_per_pod(group: dict) -> int:
    """What Ray sees: rayStartParams num-gpus if given, else the nvidia.com/gpu limit."""
    limits = group["template"]["spec"]["containers"][0]["resources"].get("limits", {})
    return int(group.get("rayStartParams", {}).get("num-gpus", limits.get("nvidia.com/gpu", 0)))


@pytest.mark.parametrize("profile", ["overlays/cpu", "overlays/gpu"])
def test_worker_gpus_fit_placement(profile):
    """The target's ranks share one pod (a STRICT_PACK placement group); drafts get pods of their own."""
    placement = operator_config(profile).placement
    groups = {group["groupName"]: group for group in pod_groups(rayservice(profile))}
    target, draft = groups["target"], groups["draft"]
    assert gpus_per_pod(groups["head"]) == 0
    assert target["replicas"] == 1
    assert gpus_per_pod(target) == math.ceil(placement.tensor_parallel_size * placement.gpus_per_actor)
    assert draft["replicas"] * gpus_per_pod(draft) == math.ceil(placement.draft_replicas * placement.gpus_per_actor)


def secret_mounts(group: dict) -> dict[str, tuple[str, bool]]:
    """A pod's Secret volumes: mount folder -> (Secret name, optional)."""
    pod = group["template"]["spec"]
    secrets = {volume["name"]: volume["secret"] for volume in pod["volumes"] if "secret" in volume}
    (container,) = pod["containers"]
    return {mount["mountPath"]: (secrets[mount["name"]]["secretName"], secrets[mount["name"]].get("optional", False))
            for mount in container["volumeMounts"] if mount["name"] in secrets and not mount.get("subPath")}


@pytest.mark.parametrize("profile", PROFILES)
def test_security_files_come_from_secrets_in_every_pod(profile):
    """Every file the operator YAML's security section names is in a Secret mounted, as a folder, in
    every pod (the ingress and the actors may land on any of them): the API keys in specdec-api-keys,
    the internal TLS files in specdec-internal-tls. The GPU profile asks for API keys and internal
    mTLS; the CPU profile (to try it) for neither."""
    security = operator_config(profile).security
    files = {"specdec-api-keys": [security.api_keys_file]} if security.api_keys_file else {}
    if tls := security.internal_tls:
        files["specdec-internal-tls"] = [tls.cert, tls.key, tls.ca]
    assert set(files) == (set() if profile == "overlays/cpu" else {"specdec-api-keys", "specdec-internal-tls"})
    for group in pod_groups(rayservice(profile)):
        mounts = secret_mounts(group)
        for secret, paths in files.items():
            for path in paths:
                assert mounts.get(posixpath.dirname(path), (None,))[0] == secret, (group["groupName"], path)


def test_tls_ingress_routes_to_the_serve_ports():
    """The GPU profile terminates TLS at an Ingress: HTTPS to the serve Service's `serve` port, gRPC
    (backend protocol GRPC) to the head Service's port that Serve's gRPC proxy listens on."""
    service = rayservice("overlays/gpu")
    serve, _ = serve_app(service)
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head_ports = {port["name"]: port["containerPort"] for port in head["ports"]}
    name = service["metadata"]["name"]
    backends = {}
    for ingress in rendered("overlays/gpu", "Ingress"):
        (rule,) = ingress["spec"]["rules"]
        (tls,) = ingress["spec"]["tls"]
        assert tls["hosts"] == [rule["host"]] and tls["secretName"] == "specdec-tls"
        (path,) = rule["http"]["paths"]
        annotations = ingress["metadata"].get("annotations", {})
        protocol = annotations.get("nginx.ingress.kubernetes.io/backend-protocol", "HTTP")
        backends[protocol] = (path["backend"]["service"]["name"], path["backend"]["service"]["port"]["name"])
    assert backends == {"HTTP": (f"{name}-serve-svc", "serve"), "GRPC": (f"{name}-head-svc", "serve-grpc")}
    assert head_ports["serve"] == serve["http_options"]["port"]
    assert head_ports["serve-grpc"] == serve["grpc_options"]["port"]
    assert not rendered("overlays/cpu", "Ingress")

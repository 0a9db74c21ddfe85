"""k8s/: the RayService against KubeRay's CRD schema, its serveConfigV2 against Ray Serve's schema, and
the operator YAML in the ConfigMap against cluster.config, for the base and each rendered overlay."""

import copy
import functools
import importlib
import math
import posixpath
import shutil
import subprocess
import tomllib
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
    from cluster.local import WORKER_NICENESS

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


@pytest.mark.parametrize("profile", ["overlays/cpu", "overlays/gpu"])
def test_gpus_are_logical_only_where_the_pods_have_none(profile):
    """The CPU profile's workers declare logical GPUs (rayStartParams num-gpus) and say so in the config;
    the GPU profile's come from nvidia.com/gpu limits, and an actor there that sees no CUDA refuses to start."""
    placement = operator_config(profile).placement
    workers = [group for group in pod_groups(rayservice(profile)) if group["groupName"] != "head"]
    real = [bool(group["template"]["spec"]["containers"][0]["resources"].get("limits", {}).get("nvidia.com/gpu"))
            for group in workers]
    assert all(real) or not any(real), profile
    assert placement.logical_gpus is (not real[0]), profile


def dockerfile_args() -> dict[str, str]:
    """The Dockerfile's ARG defaults."""
    lines = (K8S / "Dockerfile").read_text().splitlines()
    return dict(line[len("ARG "):].partition("=")[::2] for line in lines if line.startswith("ARG "))


def test_gpu_image_pins_a_cuda_build_of_torch():
    """By default (the GPU image) torch is an explicit version of a CUDA build, from PyTorch's CUDA index,
    checked at build time; TORCH_BUILD=cpu (the CPU image) skips the check."""
    import torch

    args = dockerfile_args()
    assert args["BASE"].endswith("-gpu") and args["TORCH_BUILD"].startswith("cu"), args
    assert args["TORCH_VERSION"] == torch.__version__.partition("+")[0], "the image's torch is the one tested"
    text = (K8S / "Dockerfile").read_text().replace("\\\n", " ")
    assert '--index-url "https://download.pytorch.org/whl/${TORCH_BUILD}"' in text
    assert '"torch==${TORCH_VERSION}+${TORCH_BUILD}"' in text
    assert 'if [ "${TORCH_BUILD}" != cpu ]; then' in text
    assert 'python -c "import torch; assert torch.version.cuda' in text
    assert "--build-arg TORCH_BUILD=cpu" in text  # how the CPU image is built


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
    the internal link's server certificate and CA in specdec-internal-tls, its client certificate in
    specdec-internal-tls-client (a certificate and key of their own, not the server's). The GPU profile
    asks for API keys and internal mTLS; the CPU profile (to try it) for neither."""
    security = operator_config(profile).security
    files = {"specdec-api-keys": [security.api_keys_file]} if security.api_keys_file else {}
    if tls := security.internal_tls:
        files["specdec-internal-tls"] = [tls.cert, tls.key, tls.ca]
        if tls.client_cert:
            files["specdec-internal-tls-client"] = [tls.client_cert, tls.client_key]
            assert {tls.client_cert, tls.client_key}.isdisjoint({tls.cert, tls.key})
    assert set(files) == (set() if profile == "overlays/cpu" else
                          {"specdec-api-keys", "specdec-internal-tls", "specdec-internal-tls-client"})
    for group in pod_groups(rayservice(profile)):
        mounts = secret_mounts(group)
        for secret, paths in files.items():
            for path in paths:
                assert mounts.get(posixpath.dirname(path), (None,))[0] == secret, (group["groupName"], path)


@pytest.mark.parametrize("profile", PROFILES)
def test_secret_files_are_readable_by_the_server_alone(profile):
    """Every pod's Secret volumes hold their files at 0440 (not Kubernetes' default 0644, which any user in
    the container reads), and the pod's fsGroup, which those files get as their group, is the group its
    containers run as: the server reads its keys, no other user does."""
    for group in pod_groups(rayservice(profile)):
        pod = group["template"]["spec"]
        secrets = [volume for volume in pod["volumes"] if "secret" in volume]
        assert secrets, group["groupName"]
        for volume in secrets:
            assert volume["secret"].get("defaultMode") == 0o440, (group["groupName"], volume["name"])
        run_as = {container["securityContext"]["runAsGroup"] for container in pod["containers"]}
        assert run_as == {pod["securityContext"]["runAsGroup"]} == {pod["securityContext"]["fsGroup"]}, group["groupName"]


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
        # nginx's own cap (1m) would refuse what the server takes: its bound on a request, in nginx's units
        limit = operator_config("overlays/gpu").server.max_request_bytes
        assert annotations.get("nginx.ingress.kubernetes.io/proxy-body-size") == f"{limit // 2**20}m", protocol
    assert backends == {"HTTP": (f"{name}-serve-svc", "serve"), "GRPC": (f"{name}-head-svc", "serve-grpc")}
    assert head_ports["serve"] == serve["http_options"]["port"]
    assert head_ports["serve-grpc"] == serve["grpc_options"]["port"]
    assert not rendered("overlays/cpu", "Ingress")


# Hardening (issue 22): who may connect to the pods, what the pods may do, which image they run.

RELEASE_LABEL = "app.kubernetes.io/instance"
ROLE_LABEL = "app.kubernetes.io/component"
# The peers a NetworkPolicy may admit besides the release's own pods, each to named ports only.
# Each in its own namespace, named (kubernetes.io/metadata.name is the API server's): a pod label alone is anyone's
# to set, in any namespace, and the dashboard the operator reaches takes Ray jobs.
NAMESPACE = "kubernetes.io/metadata.name"
OPERATOR_PEER = {"namespaceSelector": {"matchLabels": {NAMESPACE: "ray-system"}},
                 "podSelector": {"matchLabels": {ROLE_LABEL: "kuberay-operator"}}}
PROMETHEUS_PEER = {"namespaceSelector": {"matchLabels": {NAMESPACE: "monitoring"}},
                   "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}


def selects(selector: dict, labels: dict) -> bool:
    """Whether a label selector (matchLabels only: the manifests use nothing else) selects `labels`."""
    assert set(selector) <= {"matchLabels"}, f"selector {selector} uses more than matchLabels"
    return selector.get("matchLabels", {}).items() <= labels.items()


def role_ports(service: dict) -> dict[str, int]:
    """The ports the policies speak of, from where they are set: Serve's proxies (serveConfigV2), the
    head container's dashboard and GCS ports, Ray's metrics-export-port."""
    serve, _ = serve_app(service)
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]
    (container,) = head["template"]["spec"]["containers"]
    named = {port["name"]: port["containerPort"] for port in container["ports"]}
    return {"http": serve["http_options"]["port"], "grpc": serve["grpc_options"]["port"],
            "dashboard": named["dashboard"], "gcs": named["gcs-server"],
            "metrics": int(head["rayStartParams"]["metrics-export-port"])}


def reach(policy: dict, release: dict) -> dict[str, set[int] | None]:
    """Who a policy admits, and to which ports (None: every port): "release" (pods of the release,
    this namespace), "anyone" (a rule without `from`), "kuberay-operator", "prometheus". A peer of any
    other form fails: nothing else is meant to get in."""
    assert policy["spec"]["policyTypes"] == ["Ingress"], policy["metadata"]["name"]
    admitted: dict[str, set[int] | None] = {}
    for rule in policy["spec"].get("ingress", []):
        ports = None
        if "ports" in rule:
            assert all(port.get("protocol", "TCP") == "TCP" and isinstance(port["port"], int)
                       and "endPort" not in port for port in rule["ports"]), rule
            ports = {port["port"] for port in rule["ports"]}
        peers = rule.get("from")
        names = ["anyone"] if peers is None else []
        for peer in peers or []:
            if peer == {"podSelector": {"matchLabels": release}}:
                names.append("release")
            elif peer == OPERATOR_PEER:
                names.append("kuberay-operator")
            elif peer == PROMETHEUS_PEER:
                names.append("prometheus")
            else:
                raise AssertionError(f"{policy['metadata']['name']}: a peer of unknown form {peer}")
        for name in names:
            if ports is None or admitted.get(name, set()) is None:
                admitted[name] = None
            else:
                admitted[name] = admitted.get(name, set()) | ports
    return admitted


def check_reach(role: str, admitted: dict, ports: dict[str, int]) -> None:
    """The promise: from outside the release, the public API only (HTTP on every pod, since KubeRay's
    serve Service selects workers too; gRPC on the head, behind the head Service); the dashboard for
    the KubeRay operator on the head; the metrics for Prometheus. Everything else (GCS, dashboard,
    Ray's ports, the target's TargetService and the tensor-parallel rendezvous, which are picked free
    at start) from the release's pods only, where every port is open."""
    public = {ports["http"], ports["grpc"]} if role == "head" else {ports["http"]}
    allowed = {"release": None, "anyone": public, "prometheus": {ports["metrics"]}}
    if role == "head":
        allowed["kuberay-operator"] = {ports["dashboard"]}
    for who, got in admitted.items():
        assert who in allowed, f"{role}: {who} admitted"
        if allowed[who] is not None:
            assert got is not None and got <= allowed[who], f"{role}: {who} reaches {got}, more than {allowed[who]}"
    assert admitted.get("release", set()) is None, f"{role}: the release's pods must reach every port"
    assert admitted.get("anyone") == public, f"{role}: the public API from anywhere: {admitted.get('anyone')}"
    outside = set().union(*(got for who, got in admitted.items() if who != "release"))
    assert ports["gcs"] not in outside, f"{role}: GCS reachable from outside the release"


def release_labels(service: dict) -> dict:
    """The release's label, which every pod template carries with one value."""
    values = {group["template"]["metadata"]["labels"][RELEASE_LABEL] for group in pod_groups(service)}
    (value,) = values
    return {RELEASE_LABEL: value}


@pytest.mark.parametrize("profile", PROFILES)
def test_one_network_policy_per_role_admits_only_the_public_api_from_outside(profile):
    service = rayservice(profile)
    policies = rendered(profile, "NetworkPolicy")
    ports = role_ports(service)
    release = release_labels(service)
    for group in pod_groups(service):
        labels = group["template"]["metadata"]["labels"]
        assert labels[ROLE_LABEL] == group["groupName"]
        # each role has its own policy, and no other policy selects its pods (they would add to it)
        (policy,) = [policy for policy in policies if selects(policy["spec"]["podSelector"], labels)]
        assert policy["spec"]["podSelector"]["matchLabels"] == {**release, ROLE_LABEL: group["groupName"]}
        check_reach(group["groupName"], reach(policy, release), ports)
        assert selects({"matchLabels": release}, labels)  # the release rule admits every role's pods
    assert len(policies) == len(pod_groups(service))


@pytest.mark.parametrize("role, mutate, complaint", [
    ("head", lambda spec: spec["ingress"][1]["ports"].append({"protocol": "TCP", "port": 6379}), "anyone reaches"),
    ("target", lambda spec: spec["ingress"][1]["ports"].append({"protocol": "TCP", "port": 9000}), "anyone reaches"),
    ("draft", lambda spec: spec["ingress"][1].pop("ports"), "anyone reaches None"),
    ("head", lambda spec: spec["ingress"][2].pop("ports"), "kuberay-operator reaches None"),
    ("target", lambda spec: spec["ingress"].append({"from": [OPERATOR_PEER]}), "kuberay-operator admitted"),
    ("draft", lambda spec: spec["ingress"][0]["from"][0].update(namespaceSelector={}), "unknown form"),
    ("head", lambda spec: spec["ingress"][2]["from"][0].update(namespaceSelector={}), "unknown form"),  # any namespace
    ("target", lambda spec: spec["ingress"][2]["from"][0].pop("namespaceSelector"), "unknown form"),
    ("head", lambda spec: spec["ingress"].append({"from": [{"ipBlock": {"cidr": "0.0.0.0/0"}}],
                                                  "ports": [{"port": 6379}]}), "unknown form"),
    ("head", lambda spec: spec["ingress"].pop(1), "the public API from anywhere"),
])
def test_network_policy_check_rejects_a_leaky_policy(role, mutate, complaint):
    service = rayservice("base")
    release = release_labels(service)
    (policy,) = [copy.deepcopy(policy) for policy in rendered("base", "NetworkPolicy")
                 if policy["spec"]["podSelector"]["matchLabels"][ROLE_LABEL] == role]
    mutate(policy["spec"])
    with pytest.raises(AssertionError, match=complaint):
        check_reach(role, reach(policy, release), role_ports(service))


def dockerfile_user() -> tuple[int, int]:
    """The uid and gid of the Dockerfile's last USER (numeric, so the kubelet can check non-root)."""
    users = [line.split()[1] for line in (K8S / "Dockerfile").read_text().splitlines() if line.startswith("USER ")]
    uid, _, gid = users[-1].partition(":")
    return int(uid), int(gid)


def pod_containers(pod: dict) -> list[dict]:
    return [*pod.get("initContainers", []), *pod["containers"]]


@pytest.mark.parametrize("profile", PROFILES)
def test_pods_run_unprivileged_as_the_image_user(profile):
    uid, gid = dockerfile_user()
    assert uid != 0
    for group in pod_groups(rayservice(profile)):
        pod = group["template"]["spec"]
        name = group["groupName"]
        assert pod["automountServiceAccountToken"] is False, name
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True and (context["runAsUser"], context["runAsGroup"]) == (uid, gid), name
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for container in pod_containers(pod):
            own = container["securityContext"]
            assert own.get("runAsNonRoot", True) is True and own.get("runAsUser", uid) == uid, name
            assert own["allowPrivilegeEscalation"] is False and not own.get("privileged"), name
            assert own["capabilities"] == {"drop": ["ALL"]}, name
            assert own["readOnlyRootFilesystem"] is True, name
            assert own.get("seccompProfile", context["seccompProfile"]) == {"type": "RuntimeDefault"}, name


# What the pods write under a read-only root: Ray's session directory (/tmp/ray), its object store
# (/dev/shm), the libraries' caches (under ~/.cache, where the env moves Triton's and CUDA's).
WRITTEN = ["/tmp/ray", "/dev/shm", "/home/ray/.cache/huggingface"]
CACHE_ENV = ["TRITON_CACHE_DIR", "CUDA_CACHE_PATH"]


@pytest.mark.parametrize("profile", PROFILES)
def test_what_ray_writes_is_on_writable_volumes(profile):
    for group in pod_groups(rayservice(profile)):
        pod = group["template"]["spec"]
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        for container in pod_containers(pod):
            mounts = {mount["mountPath"]: mount for mount in container["volumeMounts"]}
            writable = [path for path, mount in mounts.items()
                        if "emptyDir" in volumes[mount["name"]] and not mount.get("readOnly")]
            # every other volume is read-only: config, models, Secrets
            assert all(mount.get("readOnly") for path, mount in mounts.items() if path not in writable)
            env = {var["name"]: var.get("value") for var in container.get("env", [])}
            for path in WRITTEN + [env[name] for name in CACHE_ENV]:
                assert any(path == root or path.startswith(root + "/") for root in writable), (group["groupName"], path)
            assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"].get("medium") == "Memory"
            # what is written to disk is capped, and the container's ephemeral storage holds it: a pod whose logs
            # or spilled objects run away is evicted, not the node's disk filled
            on_disk = [volumes[mounts[path]["name"]]["emptyDir"] for path in writable]
            on_disk = [d for d in on_disk if d.get("medium") != "Memory"]
            assert on_disk and all("sizeLimit" in d for d in on_disk), (group["groupName"], on_disk)
            resources = container["resources"]
            capped = sum(gibibytes(d["sizeLimit"]) for d in on_disk)
            assert gibibytes(resources["limits"]["ephemeral-storage"]) >= capped, group["groupName"]
            assert "ephemeral-storage" in resources["requests"], group["groupName"]


def gibibytes(quantity: str) -> float:
    """A Kubernetes quantity of bytes (Gi, Mi) in GiB."""
    units = {"Gi": 1.0, "Mi": 1 / 1024}
    return float(quantity[:-2]) * units[quantity[-2:]]


def image_tag(reference: str) -> str:
    """The tag of an image reference ('' without one; a registry's :port is not a tag)."""
    name = reference.partition("@")[0]
    return name.rpartition("/")[2].partition(":")[2]


def images(node) -> list[str]:
    """Every container image anywhere in a rendered object."""
    if isinstance(node, list):
        return [image for item in node for image in images(item)]
    if not isinstance(node, dict):
        return []
    found = [container["image"] for key in ("containers", "initContainers") for container in node.get(key, [])]
    return found + [image for value in node.values() for image in images(value)]


@pytest.mark.parametrize("profile", PROFILES)
def test_images_are_pinned_to_the_project_version(profile):
    """No :latest and no untagged image: the project's version, as the Dockerfile says to tag it."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    found = images(list(_render(profile)))
    assert found
    for image in found:
        assert image_tag(image) not in ("", "latest"), image
        assert image.partition("@")[0].rpartition("/")[2] == f"specdec:{version}", image
    assert f"-t specdec:{version} ." in (K8S / "Dockerfile").read_text()
    assert f"-t specdec:{version} ." in (K8S / "README.md").read_text()


def test_image_tag_check():
    assert [image_tag(ref) for ref in ["specdec", "specdec:latest", "reg:5000/specdec", "reg:5000/specdec:0.1.0",
                                       "specdec@sha256:ab"]] == ["", "latest", "", "0.1.0", ""]
    assert sorted(images({"spec": {"template": {"spec": {"initContainers": [{"image": "a:1"}], "containers": [
        {"image": "b"}]}}}})) == ["a:1", "b"]


def test_dockerfile_base_is_the_clusters_ray_version():
    ray_version = rayservice("base")["spec"]["rayClusterConfig"]["rayVersion"]
    (base,) = [line.partition("=")[2] for line in (K8S / "Dockerfile").read_text().splitlines()
               if line.startswith("ARG BASE=")]
    assert image_tag(base).startswith(f"{ray_version}-"), base


@pytest.mark.parametrize("profile", PROFILES)
def test_serve_grpc_messages_capped_like_http_bodies(profile):
    """Serve's gRPC proxy takes 2 GiB messages unless RAY_SERVE_GRPC_MAX_MESSAGE_SIZE says less; every
    pod runs a proxy, so every pod sets it, to the config's bound on an HTTP body."""
    limit = operator_config(profile).server.max_request_bytes
    assert limit == 4 * 1024 * 1024
    for group in pod_groups(rayservice(profile)):
        (container,) = group["template"]["spec"]["containers"]
        env = {var["name"]: var.get("value") for var in container.get("env", [])}
        assert env.get("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE") == str(limit), group["groupName"]

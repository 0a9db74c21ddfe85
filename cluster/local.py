"""Starting Ray and Serve in this process: the one start-up that `specdec serve`, `specdec soak`, the
benchmarks in tools/bench and the tests share. Ray and Serve are imported inside the functions, so
that a command which only parses its arguments does not pay for them."""

import os
import random
import socket
from dataclasses import dataclass

from .config import DefaultModels, ServeConfig, ServerConfig, app_config, default_models

# Ray starts its workers at nice 15, so that its own processes stay responsive; the target's step loop
# then loses its core to every nice-0 process on the machine (the raylet, GCS, agents, clients). At nice 0
# the served forward took 19 ms against 26 ms at 8 clients on the 2-core CPU (README, "Served, measured").
WORKER_NICENESS = "0"

# Serve's gRPC proxy takes messages (and sends replies) of up to this many bytes, read once when the proxy
# starts: unset, 2 GiB, so a client could make the proxy read 2 GiB before the ingress sees the request.
GRPC_MESSAGE_SIZE_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"

# What ray.init says when asked to start a cluster (num_cpus, num_gpus) where one is already running and
# RAY_ADDRESS or `ray start` makes it connect to that one instead.
EXISTING_CLUSTER_ERROR = "When connecting to an existing cluster"


@dataclass(frozen=True)
class Endpoints:
    grpc: str  # host:port of specdec.v1.SpecDecode
    http: str  # http://host:port


# Ports free_port hands out: above Ray's worker ports (10002-19999 by default) and below the kernel's
# ephemeral range, which Ray's own processes and every outgoing connection take ports from: a port picked
# there (bind to port 0) could be taken between the pick and the server's bind ("Address already in use").
PORTS_FROM = 20000
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port no one listens on now, on any interface, outside the ephemeral range, and not handed
    out before by this process (a server started soon after may bind it)."""
    ports = list(range(PORTS_FROM, _ephemeral_ports_start())) or [0]  # none below it here: let the kernel pick
    random.shuffle(ports)
    for port in ports:
        if port not in _handed_out and (port := _bound(port)):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free TCP port in [{PORTS_FROM}, {_ephemeral_ports_start()})")


def _ephemeral_ports_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bound(port: int) -> int:
    """The port a socket could bind on every interface (port 0: the kernel's choice), else 0."""
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
            return s.getsockname()[1]
        except OSError:
            return 0


def run_workers_at_nice_0() -> None:
    """For a Ray cluster this process is about to start (ray.init without an address); an operator's
    own RAY_worker_niceness wins."""
    os.environ.setdefault("RAY_worker_niceness", WORKER_NICENESS)


def serving_environment(server: ServerConfig, environ=os.environ) -> None:
    """The environment of a Ray cluster this process is about to start for serving (ray.init without an
    address; its processes inherit it): workers at nice 0, and Serve's gRPC proxy held to
    server.max_request_bytes (RESOURCE_EXHAUSTED beyond it). An operator's own values win. A cluster of
    your own (KubeRay) needs RAY_SERVE_GRPC_MAX_MESSAGE_SIZE in its pods' environment (docs/operators.md)."""
    run_workers_at_nice_0()
    environ.setdefault(GRPC_MESSAGE_SIZE_ENV, str(server.max_request_bytes))


def local_cluster(app_args: dict, default_models: DefaultModels,
                  num_gpus: float | None = None) -> tuple[ServeConfig, float, str | None]:
    """For a local Ray cluster this process is about to start (ray.init without an address): the config to
    serve, the GPUs the cluster declares (num_gpus if given, else this machine's CUDA GPUs, else as many as
    the actors ask for) and, when there is no CUDA here, a line saying those GPUs are logical: then
    app_args["logical_gpus"] is set (placement.logical_gpus: the models on the CPU), so that build_app(app_args)
    serves the same config; without it the actors would refuse a GPU they cannot see."""
    cfg = app_config(app_args, default_models)
    place, cuda = cfg.placement, _local_gpus()
    gpus = num_gpus if num_gpus is not None else cuda or (place.tensor_parallel_size + place.draft_replicas) * place.gpus_per_actor
    if cuda or not gpus or place.logical_gpus:
        return cfg, gpus, None
    app_args["logical_gpus"] = True
    note = (f"no CUDA on this machine: the local Ray cluster's {gpus:g} GPUs are logical and the models run on "
            f"the CPU (placement.logical_gpus: true)")
    return app_config(app_args, default_models), gpus, note


def actor_cpus(cfg: ServeConfig) -> int:
    """The CPUs the config's actors ask Ray for: every target rank's and every draft replica's."""
    place = cfg.placement
    return place.tensor_parallel_size * place.cpus_per_target_rank + place.draft_replicas * place.cpus_per_draft_replica


def start_ray(**init) -> None:
    """ray.init(**init), saying what to do when it would start a cluster where one already runs."""
    import ray

    try:
        ray.init(**init)
    except ValueError as e:
        if EXISTING_CLUSTER_ERROR not in str(e):
            raise
        raise ValueError(existing_cluster_advice(os.environ.get("RAY_ADDRESS"))) from None


def existing_cluster_advice(ray_address: str | None) -> str:
    """What to do when a Ray cluster is already running where a local one was to start."""
    where = f"RAY_ADDRESS={ray_address} names" if ray_address else "this machine runs"
    return (f"a Ray cluster is already running ({where} one), so a local one cannot start: join it with "
            f"`--address auto` (or its address), or stop it with `ray stop`"
            + (" and unset RAY_ADDRESS" if ray_address else ""))


def start_serve(http_port: int, grpc_port: int, host: str = "127.0.0.1", servicer: str | None = None) -> None:
    """Serve's HTTP and gRPC proxies on these ports, on the Ray cluster this process is connected to.
    `servicer` names the gRPC servicer function (default: the one `specdec serve` uses)."""
    from ray import serve

    from .serve_app import GRPC_SERVICER

    serve.start(http_options={"host": host, "port": http_port},
                grpc_options={"port": grpc_port, "grpc_servicer_functions": [servicer or GRPC_SERVICER]})


def serve_locally(app_args: dict, servicer: str | None = None) -> Endpoints:
    """A new local Ray cluster (logical GPUs, as `specdec serve` starts on a CPU machine) and Serve on
    loopback, both on the ports in app_args (free ones: the config's may be taken), serving app_args.
    `servicer` names the gRPC servicer function (default: the one `specdec serve` uses)."""
    from ray import serve

    from .serve_app import build_app

    cfg, gpus, _ = local_cluster(app_args, default_models)  # logical GPUs where there is no CUDA, as specdec serve
    serving_environment(cfg.server)  # as specdec serve runs them: workers at nice 0, gRPC messages bounded
    start_ray(num_cpus=actor_cpus(cfg) + 1, num_gpus=gpus, include_dashboard=False, log_to_driver=False)
    start_serve(app_args["http_port"], app_args["grpc_port"], servicer=servicer)
    serve.run(build_app(app_args), name="specdec", route_prefix="/")
    return Endpoints(f"127.0.0.1:{app_args['grpc_port']}", f"http://127.0.0.1:{app_args['http_port']}")


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count()

"""A target rank: owns (a shard of) the target model and its requests' KV caches. Rank 0 runs the
scheduler loop (specdec/scheduler.py), which decodes plain requests and verifies the trees that
draft replicas send over gRPC (specdec.v1.TargetService); ranks > 0 mirror rank 0's calls
(actors/lockstep.py)."""

import asyncio
import os
import threading
from collections.abc import AsyncIterator
from dataclasses import replace

import ray
import torch
import torch.distributed as dist

from protos import specdec_tree_pb2_grpc as tree_grpc
from specdec.compute import on_compute, single_threaded
from specdec.cpu_linear import packed_numel
from specdec.kvcache import CachedLM
from specdec.loading import load_grammars, load_served_model, load_sharded_model, parse_dtype
from specdec.sampling import SamplingParams
from specdec.target import TargetWorker

from . import metrics
from .lockstep import LockstepWorker, follow
from specdec.scheduler import TargetStats
from specdec.scheduler import KvBudget, TargetScheduler
from .security import RPC_HEADROOM, LinkSecurity, SharedSecurity, host_port, resolve, serve_target
from .records import StepUpdate
from .streams import FeedBatch, RequestSink, StepFeeds
from .target_service import TargetService


class NoCudaError(RuntimeError):
    """Ray gave this actor a GPU but torch sees no CUDA (a CPU build of torch in a GPU image, no driver)."""


def device_for_actor(logical_gpus: bool) -> str:
    """Where the actor's model runs: the GPU Ray gave it; the CPU when Ray gave it none or its GPUs are
    logical slots (placement.logical_gpus). A GPU from Ray without CUDA here is refused (NoCudaError), so
    that a wrong image fails at start instead of serving from its CPU."""
    gpu_ids = ray.get_gpu_ids()
    if logical_gpus or not gpu_ids:
        return "cpu"
    if not torch.cuda.is_available():
        raise NoCudaError(no_cuda_message(gpu_ids))
    return "cuda:0"  # Ray sets CUDA_VISIBLE_DEVICES to the actor's GPUs


def torch_build() -> str:
    """e.g. "torch 2.5.1+cpu (CPU-only build)", "torch 2.5.1+cu124 (CUDA 12.4 build)"."""
    cuda = torch.version.cuda
    return f"torch {torch.__version__} ({f'CUDA {cuda} build' if cuda else 'CPU-only build'})"


def no_cuda_message(gpu_ids: list) -> str:
    why = ("this torch has no CUDA" if not torch.version.cuda
           else "this torch finds no CUDA device (no driver, or the GPU is not visible in this container)")
    return (f"Ray assigned this actor GPU {', '.join(map(str, gpu_ids))} but {why}: {torch_build()}. "
            f"It will not serve from the CPU in place of its GPU. Either install a CUDA build of torch in the "
            f"image (k8s/Dockerfile pins one for the GPU image) and run it where the GPU is visible, or, if "
            f"Ray's GPUs here are logical slots and the models are meant to run on the CPU, set "
            f"placement.logical_gpus: true in the config.")


def use_assigned_cpus() -> None:
    """The models run with the CPUs Ray assigned, on the compute thread (specdec.compute); the actor's own
    threads run torch on one."""
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
    torch.set_num_threads(max(1, int(cpus)))
    single_threaded()


@ray.remote
class TargetRank:
    """Async: plain requests are streams fed by the scheduler's loop, not threads. Rank 0 runs the
    scheduler and the gRPC service; ranks > 0 follow it. The service listens on this node's address
    and answers only callers with the topology's secret (and, with TLS files, a certificate from
    its CA): actors/security.py. The secret comes through Ray's object store (SharedSecurity), so it is
    not among the actor's creation arguments."""

    def __init__(self, model_path: str, dtype: str = "float32", rank: int = 0, world_size: int = 1,
                 dist_address: str | None = None, budget: KvBudget = KvBudget(), idle_timeout_s: float = 30.0,
                 prefix_cache_tokens: int = 0, max_batched_tokens: int = 0, *, gather_trees: bool = True,
                 security: LinkSecurity | SharedSecurity, logical_gpus: bool = False,
                 head_layers: tuple[int, ...] | None = None):
        """prefix_cache_tokens: server.prefix_cache_tokens (0: no prefix cache).
        max_batched_tokens: server.max_batched_tokens (0: no chunked prefill).
        gather_trees: server.gather_trees (TargetScheduler's).
        logical_gpus: placement.logical_gpus (the models on the CPU whatever GPUs Ray gave; without it a
        GPU from Ray and no CUDA here stops the rank: device_for_actor).
        head_layers: the layers the served draft head reads (placement.served_head_layers): every row keeps its
        features there beside its cached blocks, for that head's rows (TargetWorker.head_layers)."""
        use_assigned_cpus()
        device = device_for_actor(logical_gpus)  # before anything loads: a wrong image fails here
        self.rank, self.scheduler = rank, None
        self.sinks: dict[str, RequestSink] = {}  # plain requests, by id
        self.feeds = StepFeeds()  # each ingress's steps (actors.streams)
        if world_size == 1:
            model = load_served_model(model_path, parse_dtype(dtype), device)
        else:
            group = _join_tensor_parallel_group(rank, world_size, dist_address, device)
            model = on_compute(device, load_sharded_model, model_path, parse_dtype(dtype))
        # every rank alike: they take and give back blocks alike; room for the budget's KV and the prefix cache's
        pool = budget.pool(model.config, prefix_cache_tokens)
        worker = TargetWorker(CachedLM(model, pool), load_grammars(model_path, model), head_layers)
        self.weights_held = _local_numel(model)
        if world_size > 1:
            if rank > 0:
                threading.Thread(target=follow, args=(worker, group), name="lockstep", daemon=True).start()
                return
            worker = LockstepWorker(worker, group)
        self.scheduler = TargetScheduler(worker, budget, on_forward=metrics.observe_forward,
                                         idle_timeout_s=idle_timeout_s, max_batched_tokens=max_batched_tokens or None,
                                         gather_trees=gather_trees)
        threading.Thread(target=metrics.publish_target, args=(self.scheduler.stats,), name="metrics",
                         daemon=True).start()
        self.host = ray.util.get_node_ip_address()
        # calls held at once: every Open that may wait or be admitted, and room for Verify and Close
        self.server, self.port = serve_target(TargetService(self.scheduler),
                                              tree_grpc.add_TargetServiceServicer_to_server, self.host,
                                              resolve(security),
                                              budget.max_waiting + budget.max_rows + RPC_HEADROOM)

    def ready(self) -> bool:
        return True

    async def watch(self) -> None:
        """Never returns: the ingress awaits it on every rank to learn at once that one has died."""
        await asyncio.Event().wait()

    def address(self) -> str:
        return host_port(self.host, self.port)

    def gpu_ids(self) -> list:
        return ray.get_gpu_ids()

    async def feed(self, subscriber: str) -> AsyncIterator[FeedBatch]:
        """The steps of the subscriber's plain requests (all but each one's last), as they come (actors.streams)."""
        async for batch in self.feeds.stream(subscriber):
            yield batch

    async def decode(self, request_id: str, prompt: list[int], params: SamplingParams, max_new_tokens: int,
                     eos: list[int], stream: int = 0, feed: str | None = None) -> StepUpdate | None:
        """A plain request, decoded by the scheduler's loop with every other row. Each step but the last goes
        to the `feed` subscriber's feed (None: to none); -> the last, with the finish reason and every token
        (None: cancelled). `stream` as in DraftReplica.generate."""
        sink = self.sinks[request_id] = RequestSink(request_id, self.feeds.of(feed))
        try:
            self.scheduler.decode(request_id, prompt, params, max_new_tokens, set(eos), sink, stream)
            return await sink.result()
        finally:
            self.sinks.pop(request_id, None)

    def cancel(self, request_id: str) -> None:
        """Stop a plain request (its client went away or its deadline passed)."""
        self.scheduler.close([request_id])
        if sink := self.sinks.get(request_id):
            sink.cancel()

    async def forget_prefixes(self) -> int:
        """Empty the target's prefix index between two forwards, on every rank (POST /v1/admin/forget_prefixes)
        -> the tokens it held."""
        return await asyncio.to_thread(self.scheduler.forget_prefixes)

    def stats(self) -> TargetStats:
        if self.scheduler is None:  # a rank > 0
            return TargetStats(weights_held=self.weights_held)
        return replace(self.scheduler.stats(), weights_held=self.weights_held)


def _local_numel(model: torch.nn.Module) -> int:
    """Weights this process holds (a rank's shard of a sharded model; packed linear layers included)."""
    return sum(getattr(p, "_local_tensor", p).numel() for p in model.parameters()) + packed_numel(model)


def free_address() -> str:
    """host:port on this node for torch.distributed's rendezvous (rank 0 listens there)."""
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return f"{ray.util.get_node_ip_address()}:{s.getsockname()[1]}"


def _join_tensor_parallel_group(rank: int, world_size: int, address: str, device: str) -> dist.ProcessGroup:
    """Join the target's torch.distributed group (nccl on GPUs, gloo on CPU); -> a gloo group for control."""
    cuda = device.startswith("cuda")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")  # Ray shows each rank one GPU
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{address}", rank=rank,
                            world_size=world_size)
    return dist.new_group(backend="gloo")

"""A target rank: owns the target model and its requests' KV caches, and serves
specdec.v1.TargetService over gRPC so draft replicas can send it token trees."""

from concurrent import futures

import grpc
import ray
import torch

from cluster.target_service import TargetService
from protos import specdec_tree_pb2_grpc as tree_grpc
from specdec.kvcache import CachedLM
from specdec.loading import load_model, parse_dtype
from specdec.target import TargetWorker


def device_for_actor() -> str:
    """The actor's GPU when Ray gave it one and CUDA is there; else the CPU (logical GPUs in tests)."""
    return "cuda:0" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu"


def use_assigned_cpus() -> None:
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
    torch.set_num_threads(max(1, int(cpus)))


@ray.remote
class TargetRank:
    def __init__(self, model_path: str, dtype: str = "float32", rank: int = 0, world_size: int = 1,
                 batch_window_s: float = 0.002):
        if world_size != 1:
            raise NotImplementedError("tensor_parallel_size > 1 is not built yet: run the target on one GPU")
        use_assigned_cpus()
        self.rank = rank
        model = load_model(model_path, parse_dtype(dtype), device_for_actor())
        self.service = TargetService(TargetWorker(CachedLM(model)), batch_window_s)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
        tree_grpc.add_TargetServiceServicer_to_server(self.service, self.server)
        self.port = self.server.add_insecure_port("0.0.0.0:0")
        self.server.start()

    def address(self) -> str:
        return f"{ray.util.get_node_ip_address()}:{self.port}"

    def gpu_ids(self) -> list:
        return ray.get_gpu_ids()

    def stats(self) -> dict:
        return {"forwards": self.service.forwards, "largest_batch": self.service.largest_batch,
                "open_requests": len(self.service.worker.rows)}

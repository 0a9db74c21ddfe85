"""A draft replica: owns a draft model and drives the speculation loop of the requests it is given,
sending token trees to the target group over gRPC."""

import grpc
import ray

from cluster.draft_loop import run_request
from protos import specdec_tree_pb2_grpc as tree_grpc
from specdec.drafters import make_drafter
from specdec.kvcache import CachedLM
from specdec.loading import load_model, parse_dtype
from specdec.sampling import SamplingParams

from .target_rank import device_for_actor, use_assigned_cpus


@ray.remote
class DraftReplica:
    def __init__(self, model_path: str | None, target_address: str, drafter: str = "model+ngram",
                 dtype: str = "float32", width: int = 1, depth: int = 4):
        use_assigned_cpus()
        draft = load_model(model_path, parse_dtype(dtype), device_for_actor()) if model_path else None
        self.make = lambda: make_drafter(drafter, CachedLM(draft) if draft is not None else None, width)
        self.make()  # fail here, at start, on a bad drafter/model combination
        self.depth = depth
        self.stub = tree_grpc.TargetServiceStub(grpc.insecure_channel(target_address))

    def generate(self, request_id: str, prompt: list[int], params: dict, max_new_tokens: int,
                 eos: list[int] = ()) -> dict:
        """One request, start to end; its KV cache on the target is closed when it finishes."""
        out = run_request(self.stub, self.make(), request_id, prompt, SamplingParams(**params), max_new_tokens,
                          set(eos), self.depth)
        return {"token_ids": out.token_ids, "finish_reason": out.finish_reason, "stats": out.stats.to_dict()}

    def gpu_ids(self) -> list:
        return ray.get_gpu_ids()

"""A draft replica: owns the draft model(s) and drives the speculation loop of the requests it is
given, sending token trees to the target group over gRPC."""

import grpc
import ray

from .draft_loop import GrpcTarget, run_steps
from .metrics import StepTimer
from protos import specdec_tree_pb2_grpc as tree_grpc
from specdec.drafters import make_drafter
from specdec.kvcache import CachedLM
from specdec.loading import load_model, parse_dtype
from specdec.sampling import SamplingParams

from .streams import RequestStreams
from .target_rank import device_for_actor, use_assigned_cpus


@ray.remote
class DraftReplica(RequestStreams):
    def __init__(self, drafts: dict[str, tuple[str, str]], target_address: str, drafter: str = "model+ngram",
                 width: int = 1):
        """drafts: task type -> (model folder, dtype); the "" entry drafts for every other task type."""
        super().__init__()
        use_assigned_cpus()
        self.models = {task: load_model(path, parse_dtype(dtype), device_for_actor())
                       for task, (path, dtype) in drafts.items()}
        self.drafter, self.width = drafter, width
        self.drafter_for("")  # fail here, at start, on a bad drafter/model combination
        self.target = GrpcTarget(tree_grpc.TargetServiceStub(grpc.insecure_channel(target_address)))
        name = ray.get_runtime_context().get_actor_name() or "draft"
        self.step_timer = StepTimer(name.rsplit("-", 1)[0])  # draft-<i>-<topology tag> -> draft-<i>

    def ready(self) -> bool:
        return True

    def drafter_for(self, task_type: str):
        model = self.models.get(task_type, self.models.get(""))
        return make_drafter(self.drafter, CachedLM(model) if model is not None else None, self.width)

    def generate(self, request_id: str, prompt: list[int], params: SamplingParams, max_new_tokens: int,
                 eos: list[int] = (), depth: int = 4, task_type: str = "", stream: int = 0):
        """One request, start to end, K = depth: yields each step's tokens, then a summary. Its KV
        cache on the target is closed when it finishes (or when the caller cancels it). `stream`
        separates the random streams of samples that share a seed."""
        steps = run_steps(self.target, self.drafter_for(task_type), request_id, prompt, params,
                          max_new_tokens, set(eos), depth, stream, on_step=self.step_timer)
        yield from self._stream(request_id, steps)

    def gpu_ids(self) -> list:
        return ray.get_gpu_ids()

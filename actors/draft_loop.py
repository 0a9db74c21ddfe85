"""The draft side of one request, driving speculation against a target: draft a tree, send it, keep
what the target accepted, roll the draft's cache back, repeat. With no drafter (or depth 0) every
tree is a lone root: plain decoding, one token per step. The target is a TargetService in this
process (plain requests on the target rank) or one reached over gRPC (GrpcTarget)."""

import time
from collections.abc import Callable, Iterator
from typing import Protocol

from protos import specdec_tree_pb2 as tree_pb
from specdec.acceptance import Verdict
from specdec.drafters import Drafter, Plan
from specdec.engine import Generation, emit, record_step
from specdec.sampling import SamplingParams, make_generator
from specdec.tree import TokenTree

from . import wire


class Target(Protocol):
    def open(self, request_id: str, prompt: list[int], params: SamplingParams, stream: int = 0) -> None: ...
    def verify(self, request_id: str, tree: TokenTree) -> Verdict: ...
    def close(self, request_id: str) -> None: ...


class GrpcTarget:
    """A remote target's specdec.v1.TargetService as a Target."""

    def __init__(self, stub):  # specdec_tree_pb2_grpc.TargetServiceStub
        self.stub = stub

    def open(self, request_id: str, prompt: list[int], params: SamplingParams, stream: int = 0) -> None:
        self.stub.Open(tree_pb.OpenRequest(request_id=request_id, prompt=prompt,
                                           params=wire.sampling_to_proto(params), stream=stream))

    def verify(self, request_id: str, tree: TokenTree) -> Verdict:
        reply = self.stub.Verify(tree_pb.VerifyRequest(trees=[wire.tree_to_proto(request_id, tree)]))
        return wire.verdict_from_proto(reply.results[0])[1]

    def close(self, request_id: str) -> None:
        self.stub.Close(tree_pb.CloseRequest(request_ids=[request_id]))


def run_steps(
    target: Target,
    drafter: Drafter | None,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    max_new_tokens: int,
    eos: set[int],
    depth: int = 4,
    stream: int = 0,
    on_step: Callable[[float, float], None] | None = None,
) -> Iterator[tuple[list[int], Generation]]:
    """Generate one request with `target`, yielding after every step the tokens it
    committed and the generation so far (finish_reason is final once the iterator ends). The request
    is closed on the target at the end, also when the consumer stops early. `on_step` gets each
    step's (draft, verify round trip) seconds."""
    target.open(request_id, prompt, params, stream)
    out, seq = Generation([], "length"), list(prompt)
    gen = make_generator(params.seed, stream, role="draft")
    speculate = drafter is not None and depth > 0
    if speculate:
        drafter.start(1)
    try:
        while True:
            t0 = time.perf_counter()
            tree = drafter.propose([seq], [Plan(depth, depth)], [params], [gen])[0] if speculate \
                else TokenTree.root(seq[-1])
            t1 = time.perf_counter()
            verdict = target.verify(request_id, tree)
            times = (t1 - t0, time.perf_counter() - t1)  # verify: the round trip
            record_step(out.stats, tree, verdict, times)
            if on_step:
                on_step(*times)
            if speculate:
                drafter.commit([verdict.path])
            before = len(out.token_ids)
            more = emit(out, seq, verdict, max_new_tokens, eos)
            yield out.token_ids[before:], out
            if not more:
                return
    finally:
        target.close(request_id)


def run_request(target: Target, drafter: Drafter | None, request_id: str, prompt: list[int], params: SamplingParams,
                max_new_tokens: int, eos: set[int], depth: int = 4, stream: int = 0) -> Generation:
    """run_steps to the end: the whole generation."""
    out = Generation([], "length")
    for _, out in run_steps(target, drafter, request_id, prompt, params, max_new_tokens, eos, depth, stream):
        pass
    return out


"""The draft side of one request, driving speculation against a remote target over gRPC: draft a
tree, send it, keep what the target accepted, roll the draft's cache back, repeat."""

from protos import specdec_tree_pb2 as tree_pb
from specdec.drafters import Drafter, Plan
from specdec.engine import Generation, emit
from specdec.sampling import SamplingParams, make_generator
from specdec.tree import TokenTree

from . import wire


def run_request(
    stub,  # specdec_tree_pb2_grpc.TargetServiceStub
    drafter: Drafter | None,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    max_new_tokens: int,
    eos: set[int],
    depth: int = 4,
    stream: int = 0,
) -> Generation:
    """Generate one request with the target behind `stub`; the request is closed there at the end."""
    stub.Open(tree_pb.OpenRequest(request_id=request_id, prompt=prompt, params=wire.sampling_to_proto(params),
                                  stream=stream))
    out, seq = Generation([], "length"), list(prompt)
    gen = make_generator(params.seed, stream, role="draft")
    if drafter is not None:
        drafter.start(1)
    try:
        while True:
            tree = (drafter.propose([seq], [Plan(depth, depth)], [params], [gen])[0] if drafter and depth
                    else TokenTree.root(seq[-1]))
            reply = stub.Verify(tree_pb.VerifyRequest(trees=[wire.tree_to_proto(request_id, tree)]))
            _, verdict = wire.verdict_from_proto(reply.results[0])
            if drafter is not None:
                drafter.commit([verdict.path])
            out.stats.steps += 1
            out.stats.drafted += len(tree) - 1
            out.stats.accepted += verdict.accepted
            if not emit(out, seq, verdict.tokens, max_new_tokens, eos):
                return out
    finally:
        stub.Close(tree_pb.CloseRequest(request_ids=[request_id]))

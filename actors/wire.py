"""The one place that converts between protobuf messages (protos/) and the engine's data: token
trees, verdicts, sampling settings. Messages from another process are checked here, with errors that
name what is wrong."""

import torch

from protos import specdec_api_pb2 as api
from protos import specdec_tree_pb2 as tree_pb
from specdec.acceptance import Verdict
from specdec.logprobs import TokenLogprob
from specdec.sampling import SamplingParams
from specdec.tree import DELTA, TokenTree


def tree_to_proto(request_id: str, tree: TokenTree) -> tree_pb.CandidateTree:
    return tree_pb.CandidateTree(
        request_id=request_id,
        tokens=tree.tokens,
        parents=tree.parents,
        proposal_ids=tree.proposal_ids,
        proposals=[tree_pb.Proposal(probs=q.detach().to("cpu", torch.float32).numpy().tobytes(), vocab=q.numel())
                   for q in tree.proposals],
        from_model=tree.from_model,
        guess=tree.guess,
    )


def tree_from_proto(msg: tree_pb.CandidateTree) -> tuple[str, TokenTree]:
    """-> (request id, tree); ValueError when the message is not a well-formed tree."""
    n, where = len(msg.tokens), f"tree of request {msg.request_id!r}"
    if n == 0:
        raise ValueError(f"{where}: no nodes (node 0, the root, is required)")
    for name in ("parents", "proposal_ids", "from_model"):
        if len(getattr(msg, name)) != n:
            raise ValueError(f"{where}: {len(getattr(msg, name))} {name} for {n} tokens")
    if msg.parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(msg.parents) if i):
        raise ValueError(f"{where}: parents must be -1 for the root and an earlier node for every other node")
    if any(not (pid == DELTA or 0 <= pid < len(msg.proposals)) for pid in msg.proposal_ids):
        raise ValueError(f"{where}: a proposal id is neither -1 nor one of the {len(msg.proposals)} proposals")
    proposals = []
    for i, p in enumerate(msg.proposals):
        if p.vocab < 1 or len(p.probs) != 4 * p.vocab:
            raise ValueError(f"{where}: proposal {i} has {len(p.probs)} bytes for a vocabulary of {p.vocab}")
        proposals.append(torch.frombuffer(bytearray(p.probs), dtype=torch.float32))
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[msg.parents[i]] + 1
    tree = TokenTree(tokens=list(msg.tokens), parents=list(msg.parents), depths=depths,
                     proposal_ids=list(msg.proposal_ids), proposals=proposals, from_model=list(msg.from_model),
                     guess=list(msg.guess))
    return msg.request_id, tree


def verdict_to_proto(request_id: str, v: Verdict) -> tree_pb.VerifyResult:
    logprobs = [tree_pb.CommittedLogprob(logprob=e.logprob, top_tokens=[t for t, _ in e.top],
                                         top_logprobs=[lp for _, lp in e.top]) for e in v.logprobs]
    return tree_pb.VerifyResult(request_id=request_id, path=v.path, tokens=v.tokens, logprobs=logprobs)


def verdict_from_proto(msg: tree_pb.VerifyResult) -> tuple[str, Verdict]:
    if not msg.path or msg.path[0] != 0 or len(msg.tokens) != len(msg.path):
        raise ValueError(f"verdict of request {msg.request_id!r}: a path starts at the root (0) and commits "
                         f"one token per accepted node plus the target's own (path {list(msg.path)}, "
                         f"{len(msg.tokens)} tokens)")
    if len(msg.logprobs) not in (0, len(msg.tokens)) or any(len(e.top_tokens) != len(e.top_logprobs)
                                                             for e in msg.logprobs):
        raise ValueError(f"verdict of request {msg.request_id!r}: logprobs are one per token ({len(msg.logprobs)} "
                         f"for {len(msg.tokens)} tokens), each with as many top tokens as top logprobs")
    logprobs = [TokenLogprob(token, e.logprob, list(zip(e.top_tokens, e.top_logprobs)))
                for token, e in zip(msg.tokens, msg.logprobs)]
    return msg.request_id, Verdict(path=list(msg.path), tokens=list(msg.tokens), logprobs=logprobs)


def sampling_to_proto(p: SamplingParams) -> tree_pb.SamplingParams:
    return tree_pb.SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed,
                                  logprobs=p.logprobs)


def sampling_from_proto(req: api.GenerateRequest | tree_pb.SamplingParams) -> SamplingParams:
    """ValueError naming the field when temperature, top_k, top_p or logprobs is out of range."""
    return SamplingParams(temperature=req.temperature, top_k=req.top_k,
                          top_p=req.top_p if req.HasField("top_p") else 1.0,
                          seed=req.seed if req.HasField("seed") else None,
                          logprobs=req.logprobs if req.HasField("logprobs") else None)

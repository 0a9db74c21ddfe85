"""The one place that converts between protobuf messages (protos/) and the engine's data: token
trees, verdicts, sampling settings. Messages from another process are checked here, with errors that
name what is wrong (InvalidArgument with the field), and per-row outcomes (a verdict or that row's
error) go both ways through one table of the core's typed errors and gRPC status codes."""

import logging
from dataclasses import dataclass

import grpc
import torch

from protos import specdec_api_pb2 as api
from protos import specdec_tree_pb2 as tree_pb
from specdec.acceptance import Verdict
from specdec.device import HOST
from specdec.errors import (InvalidArgument, RequestExists, RequestFailed, ResourceExhausted, Unavailable,
                            UnknownRequest)
from specdec.logprobs import TokenLogprob
from specdec.sampling import SamplingParams
from specdec.drafter_kinds import MAX_DEPTH, MAX_PROPOSAL_TOP_K, MAX_TREE_WIDTH
from specdec.kvcache import feature_dtype
from specdec.tree import DELTA, Proposal, TokenTree


def tree_to_proto(request_id: str, tree: TokenTree) -> tree_pb.CandidateTree:
    return tree_pb.CandidateTree(
        request_id=request_id,
        tokens=tree.tokens,
        parents=tree.parents,
        proposal_ids=tree.proposal_ids,
        proposals=_proposals_to_proto(tree.proposals),
        from_model=tree.from_model,
        guess=tree.guess,
    )


def _proposals_to_proto(proposals: list[Proposal]) -> list[tree_pb.Proposal]:
    """Each proposal's entries of nonzero probability; they leave the draft's device in one copy per tree."""
    if not proposals:
        return []
    ids = torch.cat([q.ids for q in proposals]).to(HOST, torch.int32)  # [E]
    probs = torch.cat([q.probs for q in proposals]).detach().to(HOST, torch.float32)  # [E]
    out, at = [], 0
    for q in proposals:
        kept = probs[at:at + len(q)] > 0
        out.append(tree_pb.Proposal(ids=ids[at:at + len(q)][kept].numpy().tobytes(),
                                    probs=probs[at:at + len(q)][kept].numpy().tobytes()))
        at += len(q)
    return out


# A tree's place in a VerifyRequest beyond its own bytes: its field's tag and length (a varint of <= 5 bytes).
TREE_FRAMING_BYTES = 6
# The most a tree's result may take in the VerifyResponse (upper bounds from protobuf's encoding, not guesses):
# its framing and request id; then a verdict's path and tokens headers and its features' header, and for each node
# of its path its index and token (int32 varints, <= 5 bytes each), a CommittedLogprob where the request asked for
# k logprobs (its header and logprob, and k ids and k floats) and the features' row; or a RowError, whose field
# and message are cut to MAX_ROW_ERROR_BYTES each.
MAX_ROW_ERROR_BYTES = 256
REPLY_FRAMING_BYTES = 5 + 3  # the result's tag and length, the request id's tag and length
VERDICT_HEADER_BYTES = 6 + 34  # path's and tokens' packed headers; the features message's header
ERROR_REPLY_BYTES = 3 + 6 + 2 * (3 + MAX_ROW_ERROR_BYTES)
NODE_ID_BYTES = 10


def logprob_bytes(k: int | None) -> int:
    """A committed token's CommittedLogprob on the wire, at most, for a request that asked for k (None: none)."""
    return 0 if k is None else 3 + 5 + 4 + 9 * k


def reply_bytes(rid: str, nodes: int, per_node: int) -> int:
    """The most a VerifyResult of a path of `nodes` may take, each node `per_node` bytes besides its ids."""
    return REPLY_FRAMING_BYTES + len(rid.encode()) + max(ERROR_REPLY_BYTES,
                                                         VERDICT_HEADER_BYTES + nodes * (NODE_ID_BYTES + per_node))


def verify_requests(trees: dict[str, TokenTree], limit: int, reply_bytes_per_node: int = 0,
                    logprobs: dict[str, int | None] | None = None) -> tuple[list[tree_pb.VerifyRequest],
                                                                             dict[str, Exception]]:
    """The trees as VerifyRequests of at most `limit` bytes each (the link's message limit), in order, as few
    as fit, and the requests whose tree alone is over the limit, each with its own error (RequestFailed,
    naming its size and the limit): it fails its request, never the others sent beside it. With
    `reply_bytes_per_node` (the features each verdict carries per node of its path), a tree also counts the
    most its verdict may bring back, so that the reply to each request fits the limit too: its ids and, where
    `logprobs` says the request asked for them (rid -> k), its logprobs as well as its features (reply_bytes)."""
    messages, refused = [], {}
    batch, size = [], 0
    for rid, tree in trees.items():
        msg = tree_to_proto(rid, tree)
        per_node = reply_bytes_per_node + logprob_bytes((logprobs or {}).get(rid))
        n = max(msg.ByteSize() + TREE_FRAMING_BYTES, reply_bytes(rid, tree.depth + 1, per_node))
        if n > limit:
            refused[rid] = RequestFailed(f"its candidate tree ({len(tree)} nodes, {len(tree.proposals)} proposals) "
                                         f"is {n} bytes, over the draft-to-target link's message limit of {limit} "
                                         "bytes (a smaller speculation.proposal_top_k, tree_width or max_k fits)")
            continue
        if batch and size + n > limit:
            messages.append(tree_pb.VerifyRequest(trees=batch))
            batch, size = [], 0
        batch.append(msg)
        size += n
    if batch:
        messages.append(tree_pb.VerifyRequest(trees=batch))
    return messages, refused


# What the target takes from another process at most, before any work (held here, at the wire; the
# target also holds each tree to its own `tree_room` and token ids to its vocabulary, which it knows).
# nodes of one candidate tree: the largest any served shape drafts (a model's widest tree, and a lookup's guesses
# merged in; the target holds each to its own tree_room), as a tree of n nodes costs an n x n mask per row
MAX_WIRE_TREE_NODES = 1 + MAX_TREE_WIDTH * MAX_DEPTH + MAX_DEPTH
MAX_WIRE_VOCAB = 1 << 20  # token ids a proposal may name: [0, MAX_WIRE_VOCAB) (the largest vocabularies are ~256k)
PROB_SUM_TOLERANCE = 1e-3  # |sum(q) - 1| allowed: float32 sums of a softmax over ~10^5 entries stay well inside
MAX_REQUEST_ID_CHARS = 128


def check_request_id(rid: str, field: str) -> None:
    if not rid:
        raise InvalidArgument(field, "must not be empty")
    if len(rid) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(field, f"is {len(rid)} characters, over {MAX_REQUEST_ID_CHARS}")


def tree_from_proto(msg: tree_pb.CandidateTree, index: int = 0) -> tuple[str, TokenTree]:
    """-> (request id, tree); InvalidArgument naming the field (`trees[<index>].<field>`, the tree's place in
    its VerifyRequest) when the message is not a well-formed tree. Checked with tensor ops over whole fields,
    not per vocabulary entry."""
    at = f"trees[{index}]"
    check_request_id(msg.request_id, f"{at}.request_id")
    n = len(msg.tokens)
    if n == 0:
        raise InvalidArgument(f"{at}.tokens", "no nodes (node 0, the root, is required)")
    if n > MAX_WIRE_TREE_NODES:
        raise InvalidArgument(f"{at}.tokens", f"{n} nodes, over the most a tree may have ({MAX_WIRE_TREE_NODES})")
    for name in ("parents", "proposal_ids", "from_model"):
        if len(getattr(msg, name)) != n:
            raise InvalidArgument(f"{at}.{name}", f"{len(getattr(msg, name))} {name} for {n} tokens")
    if len(msg.guess) > MAX_WIRE_TREE_NODES:
        raise InvalidArgument(f"{at}.guess", f"{len(msg.guess)} tokens, over {MAX_WIRE_TREE_NODES}")
    if len(msg.proposals) > n:
        raise InvalidArgument(f"{at}.proposals", f"{len(msg.proposals)} proposals for {n} nodes")
    tokens = torch.tensor(msg.tokens, dtype=torch.long, device=HOST)
    if (tokens < 0).any():
        raise InvalidArgument(f"{at}.tokens", f"token ids must be >= 0, got {int(tokens.min())}")
    if msg.guess and min(msg.guess) < 0:
        raise InvalidArgument(f"{at}.guess", f"token ids must be >= 0, got {min(msg.guess)}")
    parents = torch.tensor(msg.parents, dtype=torch.long, device=HOST)
    if parents[0] != -1 or ((parents[1:] < 0) | (parents[1:] >= torch.arange(1, n, device=HOST))).any():
        raise InvalidArgument(f"{at}.parents",
                              "parents must be -1 for the root and an earlier node for every other node")
    pids = torch.tensor(msg.proposal_ids, dtype=torch.long, device=HOST)
    if ((pids != DELTA) & ((pids < 0) | (pids >= len(msg.proposals)))).any():
        raise InvalidArgument(f"{at}.proposal_ids",
                              f"a proposal id is neither -1 nor one of the {len(msg.proposals)} proposals")
    proposals, owner, entry_ids = _proposals_from_proto(msg.proposals, at)
    if (i := _drawn_outside(tokens[1:], pids[1:], owner, entry_ids)) is not None:  # the root is committed, not drawn
        raise InvalidArgument(f"{at}.tokens", f"a node drawn from proposal {i} holds a token that proposal "
                                              "gives no probability")
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[msg.parents[i]] + 1
    tree = TokenTree(tokens=list(msg.tokens), parents=list(msg.parents), depths=depths,
                     proposal_ids=list(msg.proposal_ids), proposals=proposals, from_model=list(msg.from_model),
                     guess=list(msg.guess))
    return msg.request_id, tree


def _drawn_outside(tokens: torch.Tensor, pids: torch.Tensor, owner: torch.Tensor, ids: torch.Tensor) -> int | None:
    """The first proposal one of whose nodes holds a token it gives no probability (a drafted token was drawn from
    its proposal: q(token) > 0), or None. tokens, pids [n] the nodes'; owner, ids [entries] every proposal's
    entries, whose proposal and token: one isin, whatever the nodes and proposals."""
    drawn = pids != DELTA
    if not drawn.any():
        return None
    tokens, pids = tokens[drawn], pids[drawn]
    held = (tokens < MAX_WIRE_VOCAB) & torch.isin(pids * MAX_WIRE_VOCAB + tokens, owner * MAX_WIRE_VOCAB + ids)
    return None if held.all() else int(pids[~held][0])


def _proposals_from_proto(msgs, at: str) -> tuple[list[Proposal], torch.Tensor, torch.Tensor]:
    """A tree's proposals, each q checked to be a distribution: 1..MAX_PROPOSAL_TOP_K distinct ids in the wire's
    range, each with a finite probability > 0, summing to 1 -> (the proposals, and every entry's proposal and id
    [entries]). InvalidArgument naming the first proposal that is not. All of a tree's entries are checked at once
    (a sampled tree carries a proposal a node): a few tensor ops a tree, not a few a proposal."""
    for i, p in enumerate(msgs):
        field = f"{at}.proposals[{i}]"
        if len(p.ids) % 4 or not 1 <= len(p.ids) // 4 <= MAX_PROPOSAL_TOP_K:
            raise InvalidArgument(f"{field}.ids", f"{len(p.ids)} bytes: must hold 1..{MAX_PROPOSAL_TOP_K} token ids "
                                                  "(int32: 4 bytes each)")
        if len(p.probs) != len(p.ids):
            raise InvalidArgument(f"{field}.probs", f"{len(p.probs)} bytes for {len(p.ids) // 4} ids "
                                                    "(float32: 4 bytes each, one per id)")
    empty = torch.zeros(0, dtype=torch.long, device=HOST)
    if not msgs:
        return [], empty, empty
    sizes = [len(p.ids) // 4 for p in msgs]
    owner = torch.repeat_interleave(torch.arange(len(msgs), device=HOST),
                                    torch.tensor(sizes, dtype=torch.long, device=HOST))  # [entries]
    ids = torch.frombuffer(bytearray(b"".join(p.ids for p in msgs)), dtype=torch.int32).to(torch.long)  # [entries]
    q = torch.frombuffer(bytearray(b"".join(p.probs for p in msgs)), dtype=torch.float32)  # [entries]

    def first(bad: torch.Tensor) -> int | None:  # the first proposal with a bad entry
        return int(owner[bad.nonzero()[0, 0]]) if bad.any() else None

    if (i := first((ids < 0) | (ids >= MAX_WIRE_VOCAB))) is not None:
        raise InvalidArgument(f"{at}.proposals[{i}].ids", f"token ids must be in 0..{MAX_WIRE_VOCAB - 1}")
    keys = owner * MAX_WIRE_VOCAB + ids
    sorted_keys, order = keys.sort()
    if (i := first(torch.zeros_like(ids, dtype=torch.bool).index_fill_(
            0, order[1:][sorted_keys[1:] == sorted_keys[:-1]], True))) is not None:
        raise InvalidArgument(f"{at}.proposals[{i}].ids", "a token id appears twice (each entry is one token's "
                                                          "probability)")
    if (i := first(~torch.isfinite(q))) is not None:
        raise InvalidArgument(f"{at}.proposals[{i}].probs", "probabilities must be finite (NaN or infinity found)")
    if (i := first(q <= 0)) is not None:
        raise InvalidArgument(f"{at}.proposals[{i}].probs", f"probabilities must be > 0 (an id of none is left out), "
                                                            f"got {float(q[owner == i].min())}")
    totals = torch.zeros(len(msgs), dtype=torch.float64, device=HOST).index_add_(0, owner, q.double())  # [P]
    if ((totals - 1).abs() > PROB_SUM_TOLERANCE).any():
        i = int(((totals - 1).abs() > PROB_SUM_TOLERANCE).nonzero()[0, 0])
        raise InvalidArgument(f"{at}.proposals[{i}].probs", f"probabilities must sum to 1 (within "
                                                            f"{PROB_SUM_TOLERANCE}), got {float(totals[i]):.6g}")
    return [Proposal(a, b) for a, b in zip(ids.split(sizes), q.split(sizes))], owner, ids


# --- the target's hidden states (a draft head's features) -----------------------------------------------------

FEATURE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MAX_FEATURE_WIDTH = 1 << 16  # values per row (3 x the widest hidden sizes, ~16k, fits many times over)


def features_to_proto(features: torch.Tensor) -> tree_pb.Features:
    """features [rows, width] -> their bytes, in 16 bits (specdec.kvcache.feature_dtype: the target keeps them so
    already), leaving the device in one copy."""
    dtype = feature_dtype(features.dtype)
    name = next(n for n, d in FEATURE_DTYPES.items() if d == dtype)
    host = features.detach().to(dtype).to(HOST).contiguous()
    data = host.view(torch.int16).numpy().tobytes()  # numpy has no bfloat16: its bytes, as int16
    return tree_pb.Features(data=data, rows=host.shape[0], width=host.shape[1], dtype=name)


def features_from_proto(msg: tree_pb.Features, field: str, rows: int | None = None) -> torch.Tensor:
    """-> [rows, width] on the host, in the wire's dtype; InvalidArgument naming the field when the message is
    not a rows x width block of its dtype (or not `rows` rows, when given)."""
    if msg.dtype not in FEATURE_DTYPES:
        raise InvalidArgument(f"{field}.dtype", f"{msg.dtype!r}: must be one of {', '.join(FEATURE_DTYPES)}")
    if msg.rows < 0 or not 1 <= msg.width <= MAX_FEATURE_WIDTH:
        raise InvalidArgument(f"{field}.width", f"{msg.rows} rows of {msg.width} values: rows >= 0, width in "
                                                f"1..{MAX_FEATURE_WIDTH}")
    if rows is not None and msg.rows != rows:
        raise InvalidArgument(f"{field}.rows", f"{msg.rows} rows, expected {rows}")
    dtype = FEATURE_DTYPES[msg.dtype]
    size = dtype.itemsize
    if len(msg.data) != msg.rows * msg.width * size:
        raise InvalidArgument(f"{field}.data", f"{len(msg.data)} bytes for {msg.rows} x {msg.width} {msg.dtype} values")
    if not msg.rows:
        return torch.zeros(0, msg.width, dtype=dtype, device=HOST)
    return torch.frombuffer(bytearray(msg.data), dtype=dtype).view(msg.rows, msg.width)


def feature_rows_that_fit(width: int, dtype: torch.dtype, limit: int) -> int:
    """Rows of hidden states one message of `limit` bytes holds (with room for its framing), at least 1."""
    return max(1, (limit - 1024) // (width * feature_dtype(dtype).itemsize))


@dataclass(frozen=True)
class OpenArgs:
    """An OpenRequest, checked: what TargetScheduler.open takes."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    stream: int
    max_new_tokens: int
    feature_layers: tuple[int, ...] = ()


def open_from_proto(msg: tree_pb.OpenRequest) -> OpenArgs:
    """InvalidArgument naming the field when an OpenRequest is malformed (the target holds the prompt to its
    vocabulary and the request to its KV budget itself)."""
    check_request_id(msg.request_id, "request_id")
    if not msg.prompt:
        raise InvalidArgument("prompt", "the prompt is empty (it needs at least one token)")
    if min(msg.prompt) < 0:
        raise InvalidArgument("prompt", f"token ids must be >= 0, got {min(msg.prompt)}")
    if msg.max_new_tokens < 0:
        raise InvalidArgument("max_new_tokens", f"must be >= 0, got {msg.max_new_tokens}")
    if msg.stream < 0:
        raise InvalidArgument("stream", f"must be >= 0, got {msg.stream}")
    if len(msg.feature_layers) > 8 or any(i < 0 for i in msg.feature_layers):
        raise InvalidArgument("feature_layers", f"{list(msg.feature_layers)}: at most 8 layer ids, each >= 0")
    try:
        params = sampling_from_proto(msg.params)
    except InvalidArgument as e:
        raise InvalidArgument(f"params.{e.field}", e.reason) from None
    return OpenArgs(msg.request_id, list(msg.prompt), params, msg.stream, msg.max_new_tokens, tuple(msg.feature_layers))


def verdict_to_proto(request_id: str, v: Verdict) -> tree_pb.VerifyResult:
    logprobs = [tree_pb.CommittedLogprob(logprob=e.logprob, top_tokens=[t for t, _ in e.top],
                                         top_logprobs=[lp for _, lp in e.top]) for e in v.logprobs]
    features = features_to_proto(v.features) if v.features is not None else None
    return tree_pb.VerifyResult(request_id=request_id, path=v.path, tokens=v.tokens, logprobs=logprobs,
                                features=features)


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
    features = None
    if msg.HasField("features"):
        try:
            features = features_from_proto(msg.features, "features", rows=len(msg.path))
        except InvalidArgument as e:
            raise ValueError(f"verdict of request {msg.request_id!r}: {e}") from None
    return msg.request_id, Verdict(path=list(msg.path), tokens=list(msg.tokens), logprobs=logprobs, features=features)


def sampling_to_proto(p: SamplingParams) -> tree_pb.SamplingParams:
    return tree_pb.SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed,
                                  logprobs=p.logprobs, min_p=p.min_p, min_tokens=p.min_tokens, end_ids=p.end_ids,
                                  repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
                                  frequency_penalty=p.frequency_penalty, logit_bias=dict(p.logit_bias),
                                  grammar=p.grammar, cache_salt=p.cache_salt)


def sampling_fields(msg: api.GenerateRequest | tree_pb.SamplingParams) -> dict:
    """A message's sampling fields by SamplingParams's names, an unset optional one as its default."""
    return {"temperature": msg.temperature, "top_k": msg.top_k, "top_p": msg.top_p if msg.HasField("top_p") else 1.0,
            "seed": msg.seed if msg.HasField("seed") else None,
            "logprobs": msg.logprobs if msg.HasField("logprobs") else None, "min_p": msg.min_p,
            "min_tokens": msg.min_tokens,
            "repetition_penalty": msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
            "presence_penalty": msg.presence_penalty, "frequency_penalty": msg.frequency_penalty,
            "logit_bias": tuple(sorted(msg.logit_bias.items())),
            "cache_salt": msg.cache_salt if msg.HasField("cache_salt") else None}


def sampling_from_proto(msg: api.GenerateRequest | tree_pb.SamplingParams) -> SamplingParams:
    """InvalidArgument naming the field when a sampling field is out of range (the client API's request
    carries no end_ids and no grammar: the ingress makes them, from eos and response_format)."""
    if isinstance(msg, tree_pb.SamplingParams):
        return SamplingParams(**sampling_fields(msg), end_ids=tuple(msg.end_ids),
                              grammar=msg.grammar if msg.HasField("grammar") else None)
    return SamplingParams(**sampling_fields(msg))


# --- the core's typed errors <-> gRPC status codes (whole calls and single rows) -------------------------------

log = logging.getLogger(__name__)

ERROR_CODES = [(UnknownRequest, grpc.StatusCode.NOT_FOUND), (RequestExists, grpc.StatusCode.ALREADY_EXISTS),
               (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED), (Unavailable, grpc.StatusCode.UNAVAILABLE),
               (ValueError, grpc.StatusCode.INVALID_ARGUMENT),  # InvalidArgument is one
               (RequestFailed, grpc.StatusCode.INTERNAL)]  # by type, most specific first
INTERNAL_MESSAGE = "the target failed on this request"  # what an untyped error tells the caller (details: logs)


def code_of(kind: type[Exception]) -> grpc.StatusCode | None:
    """The gRPC status code of one of the core's typed errors (None: untyped)."""
    return next((code for typed, code in ERROR_CODES if issubclass(kind, typed)), None)


def status_of(error: Exception) -> tuple[grpc.StatusCode, str, str]:
    """-> (code, field, message) for an error of the core; `field` only for InvalidArgument (its message is
    then the reason alone). An untyped error is INTERNAL with a message that names no internals (it is logged)."""
    code = code_of(type(error))
    if code is None:
        log.error("untyped error answered as INTERNAL: %r", error, exc_info=error)
        return grpc.StatusCode.INTERNAL, "", INTERNAL_MESSAGE
    if isinstance(error, InvalidArgument):
        return code, error.field, error.reason
    return code, "", str(error)


def error_of_status(code: grpc.StatusCode, message: str, field: str = "") -> Exception:
    """The core's typed error for a status a target answered (a row's RowError, or a whole call's status)."""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        if not field:  # a whole call's status reads "field: reason" (InvalidArgument's own str)
            named, sep, reason = message.partition(": ")
            if sep and named and " " not in named:
                field, message = named, reason
        return InvalidArgument(field, message) if field else ValueError(message)
    kind = {grpc.StatusCode.NOT_FOUND: UnknownRequest, grpc.StatusCode.ALREADY_EXISTS: RequestExists,
            grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted, grpc.StatusCode.UNAVAILABLE: Unavailable}
    return kind.get(code, RequestFailed)(message)


_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def result_to_proto(request_id: str, outcome: Verdict | Exception) -> tree_pb.VerifyResult:
    """One row of a VerifyResponse: its verdict, or its error (the other rows are not affected)."""
    if isinstance(outcome, Verdict):
        return verdict_to_proto(request_id, outcome)
    code, field, message = status_of(outcome)
    return tree_pb.VerifyResult(request_id=request_id, error=tree_pb.RowError(
        code=code.value[0], field=_cut(field, MAX_ROW_ERROR_BYTES), message=_cut(message, MAX_ROW_ERROR_BYTES)))


def _cut(text: str, most: int) -> str:
    """text in at most `most` bytes of UTF-8, cut at a character."""
    return text.encode()[:most].decode(errors="ignore")


def result_from_proto(msg: tree_pb.VerifyResult) -> tuple[str, Verdict | Exception]:
    """-> (request id, its verdict or its typed error); ValueError for a malformed verdict."""
    if msg.HasField("error"):
        code = _BY_VALUE.get(msg.error.code, grpc.StatusCode.INTERNAL)
        if code == grpc.StatusCode.OK:
            code = grpc.StatusCode.INTERNAL  # an error row always fails its request
        return msg.request_id, error_of_status(code, msg.error.message, msg.error.field)
    return verdict_from_proto(msg)

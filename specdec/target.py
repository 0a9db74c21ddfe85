"""The target side of speculation: requests join and leave a running batch (continuous batching),
each keeping its own KV rows; the candidate trees of any of them are verified together in one
forward. It sees trees and sampling settings only, so the side that drafts can be another process,
and it trusts neither: a tree or prompt that could crash or poison the shared forward (a token outside
the vocabulary, a position past the model's context, more nodes than the request reserved) is refused
for its own request before the forward, and a row whose acceptance fails ends alone; the others in the
batch go on."""

import itertools
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from .acceptance import SampledRow, Verdict, accept_greedy, accept_sampling
from .device import HOST, to_host
from .errors import InvalidArgument, RequestExists, RequestFailed, UnknownRequest
from .grammar import Grammars, RowGrammar
from .kvcache import CachedLM, Prefilled, compacting, layer_features
from .logprobs import committed_logprobs
from .blocks import PrefixStats
from .processors import History, process
from .sampling import SamplingParams, make_generator
from .tree import TokenTree, layout

log = logging.getLogger(__name__)
PROPOSAL_MASS_TOLERANCE = 1e-3  # float32 rounding a proposal may leave on ids the target does not have
Outcome = Verdict | Exception  # a row's verdict, or the typed error that ended it alone


class ChunksFailed(RuntimeError):
    """A verify forward with prompts' chunks riding in it failed, and left the batch as it was: run without
    them, it may not (the chunks may be what did not fit)."""


@dataclass
class _Request:
    seq: list[int]  # committed tokens; the cache holds all but the last, the root of the next tree
    params: SamplingParams
    generator: torch.Generator  # the target side's random stream (acceptance, bonus tokens)
    prompt_len: int  # len(seq) when it joined: the tokens after it are the ones it generated
    grammar: RowGrammar | None = None  # its response_format's matcher, at the tokens it has committed
    feature_layers: tuple[int, ...] = ()  # the layers whose inputs its verdicts carry (a draft head's)
    # with the prefix cache on, a head's row's feature_layers, or a plain row's TargetWorker.head_layers (when its
    # cached prefix had their features): the features there of its committed tokens but the last (its prompt's,
    # then each verdict's), kept with its blocks when it leaves, for a head's next row that begins the same way
    kept_layers: tuple[int, ...] = ()
    features: list[torch.Tensor] | None = None

    @property
    def history(self) -> History:
        return History(self.seq, self.prompt_len)

    def commit(self, tokens: list[int]) -> None:
        self.seq += tokens
        if self.grammar is not None:
            self.grammar.commit(tokens)


@dataclass
class _Joining:
    """Requests begun (TargetWorker.begin), their prompts being prefilled before they join."""

    joining: list[tuple[Hashable, list[int], SamplingParams, int]]
    feature_layers: dict[Hashable, tuple[int, ...]]
    grammars: dict[Hashable, RowGrammar]
    prefilled: Prefilled  # its wants_last: the rows begun in decide_first


@dataclass(frozen=True)
class Opened:
    """A speculative request admitted and prefilled: its first verdict (its first token, committed: the
    next tree is rooted at it) and, where its prompt's features were asked for, those features [len(prompt),
    F] (None where they wait for prompt_features)."""

    first: Verdict
    features: torch.Tensor | None = None


@dataclass
class Joined:
    """What complete says of requests that joined: prompt features (those begun with feature_layers: [n, F]
    each, n the tokens prefilled: the whole prompt where the first token was decided, else all but the last)
    and first verdicts (those begun in decide_first)."""

    features: dict[Hashable, torch.Tensor]
    first: dict[Hashable, Outcome]


class TargetWorker:
    def __init__(self, lm: CachedLM, grammars: Grammars | None = None, head_layers: tuple[int, ...] | None = None):
        """grammars: the target's tokenizer for requests with a grammar (None: such requests are refused).
        head_layers: the layers a served draft head reads, known at start (head_layers below; else learned from
        the first head's row)."""
        self.lm, self.grammars = lm, grammars
        lm.reset(0)
        self.requests: dict[Hashable, _Request] = {}
        self.rows: list[Hashable] = []  # batch row -> request id
        self._joining: dict[int, _Joining] = {}  # by handle: requests begun, being prefilled (begin)
        self._handles = itertools.count()
        config = lm.model.config.get_text_config()
        self.vocab_size: int = config.vocab_size  # token ids the embedding takes: [0, vocab_size)
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)
        self.num_layers: int = config.num_hidden_layers
        # with the prefix cache on: the layers of the latest draft head's row; a plain row keeps its features there too,
        # so a head's later row takes the prompts (and answers) plain rows ran before it, as it does a head's row's
        self.head_layers: tuple[int, ...] | None = None
        if head_layers and lm.prefix is not None:
            self.check_layers(tuple(head_layers))
            self.head_layers = tuple(head_layers)

    def check_request(self, prompt: list[int], params: SamplingParams) -> None:
        """InvalidArgument naming the field unless the prompt is 1..max_positions ids of the vocabulary,
        logit_bias names ids of the vocabulary and a grammar compiles against the target's tokenizer."""
        self._check_fields(prompt, params)
        if params.grammar is not None:
            self.grammars.check(params.grammar)

    def _check_fields(self, prompt: list[int], params: SamplingParams) -> None:
        """check_request but the grammar's compilation (add compiles it once, into the request's matcher)."""
        self.check_prompt(prompt)
        if params.logit_bias and max(t for t, _ in params.logit_bias) >= self.vocab_size:
            raise InvalidArgument("logit_bias", f"names a token id outside the vocabulary [0, {self.vocab_size})")
        if params.grammar is not None and self.grammars is None:
            raise InvalidArgument("response_format", "this target was started without its tokenizer, so it "
                                                     "serves no grammar")

    def check_prompt(self, prompt: list[int]) -> None:
        """InvalidArgument("prompt") unless the prompt is 1..max_positions ids of the vocabulary."""
        if not prompt:
            raise InvalidArgument("prompt", "is empty: it needs at least one token")
        if self.max_positions and len(prompt) > self.max_positions:
            raise InvalidArgument("prompt", f"is {len(prompt)} tokens, past the model's context of "
                                            f"{self.max_positions} positions")
        if not 0 <= min(prompt) <= max(prompt) < self.vocab_size:
            raise InvalidArgument("prompt", f"holds a token id outside the vocabulary [0, {self.vocab_size})")

    def add(self, joining: list[tuple[Hashable, list[int], SamplingParams, int]],
            feature_layers: dict[Hashable, tuple[int, ...]] | None = None) -> dict[Hashable, torch.Tensor]:
        """Requests (id, prompt, params, stream) join the batch; their prompts are prefilled in one forward
        of their own (the running rows are not padded along), but for their last tokens, the roots of their
        first trees. `feature_layers`: requests whose verdicts carry the inputs of these layers of the target
        (a draft head's features). -> those requests' prompt features [len(prompt) - 1, F]: the prompt's
        tokens but the last, which the first tree's verdict carries as its root's"""
        return self.complete(self.begin(joining, feature_layers)).features

    def begin(self, joining: list[tuple[Hashable, list[int], SamplingParams, int]],
              feature_layers: dict[Hashable, tuple[int, ...]] | None = None, budget: int | None = None,
              decide_first: Sequence[Hashable] = ()) -> int:
        """add, in steps (chunked prefill): check the requests (raising as add does) and prefill up to `budget`
        of their prompts' tokens (None: all), then advance runs more and complete joins them. -> a handle
        for those calls. Requests with feature_layers get their prompts' features as their chunks run. Requests
        in decide_first (the scheduler's: all) have their first token decided from their
        prompt's last token as it is prefilled (as vLLM does), not by a first tree's verify a step later:
        complete commits it and says it (Joined.first), and their features cover the whole prompt. The
        others' prompts are prefilled but for their last token, which a first tree takes as its root."""
        feature_layers, decide_first = feature_layers or {}, set(decide_first)
        grammars = {}
        for rid, prompt, params, _ in joining:
            if rid in self.requests:
                raise RequestExists(f"request {rid!r} is already in the batch")
            self._check_fields(prompt, params)
            self.check_layers(feature_layers.get(rid, ()))
            if params.grammar is not None:
                grammars[rid] = self.grammars.matcher(params.grammar)  # InvalidArgument if it does not compile
        first = [rid in decide_first for rid, _, _, _ in joining]
        chunks = [prompt if last else prompt[:-1] for (_, prompt, _, _), last in zip(joining, first)]
        if self.lm.prefix is not None and any(feature_layers.values()):
            self.head_layers = tuple(next(layers for layers in feature_layers.values() if layers))
        prefilled = self.lm.prefill_alone(chunks, budget=budget, wants_last=first,
                                          salts=[params.cache_salt for _, _, params, _ in joining],
                                          layers=[feature_layers.get(rid) for rid, _, _, _ in joining],
                                          keep_layers=self.head_layers)
        handle = next(self._handles)
        self._joining[handle] = _Joining(joining, feature_layers, grammars, prefilled)
        return handle

    def advance(self, handle: int, budget: int) -> int:
        """Prefill up to `budget` more tokens of begin's requests -> tokens run (0: they are all prefilled)."""
        return self._joining[handle].prefilled.advance(budget)

    def remaining(self, handle: int) -> int:
        """Tokens of begin's prompts not prefilled yet."""
        return self._joining[handle].prefilled.remaining

    def abandon(self, handle: int) -> None:
        """begin's requests will not join (their prefill failed, say): their blocks go back now; nothing if they
        already joined."""
        if (pending := self._joining.pop(handle, None)) is not None:
            pending.prefilled.drop()

    def complete(self, handle: int) -> Joined:
        """begin's requests join the batch, their prompts prefilled -> add's features, and the first verdicts
        of those begun in decide_first (committed: each such row's next root is its first token)."""
        pending = self._joining.pop(handle)
        joining, feature_layers, grammars, prefilled = (pending.joining, pending.feature_layers, pending.grammars,
                                                        pending.prefilled)
        prefilled.check_ran()  # ValueError while some of it is not prefilled (advance)
        features, first, kept = {}, {}, {}
        for b, ((rid, _, params, _), chunk) in enumerate(zip(joining, prefilled.chunks)):
            if layers := (prefilled.layers[b] if prefilled.layers else None):  # a head's row's, or kept for one
                kept[rid] = (layers, prefilled.row_features(b))  # the cached prefix's, then those of the chunks run
                prefilled.lm.keep_features(b, chunk, params.cache_salt, layers, kept[rid][1])
                if rid in feature_layers:
                    features[rid] = kept[rid][1]
        self.lm.join(prefilled)
        for b, (rid, prompt, params, stream) in enumerate(joining):
            gen = make_generator(params.seed, stream, self.lm.device, role="target")
            layers, row_features = kept.get(rid, ((), None))
            self.requests[rid] = _Request(list(prompt), params, gen, len(prompt), grammars.get(rid),
                                          tuple(feature_layers.get(rid, ())),
                                          layers if self.lm.prefix is not None else (),
                                          [row_features] if layers and self.lm.prefix is not None else None)
            self.rows.append(rid)
            if prefilled.wants_last[b]:
                first[rid] = self._first_verdict(rid, prefilled.last[b])
        return Joined(features, first)

    def _first_verdict(self, rid: Hashable, logits: torch.Tensor) -> Outcome:
        """A joining row's first token, decided from its prompt's last token's logits [V] as a verify of its
        root alone decides it, and committed (that token's KV is in the cache already)."""
        tree = TokenTree.root(self.requests[rid].seq[-1])
        raw = logits.unsqueeze(0)  # [1, V]
        held = self._row_logits(rid, tree, raw)
        (argmax,) = to_host(held.argmax(-1))
        (outcome,) = self._decide([rid], [tree], [argmax], [held], [raw])
        if isinstance(outcome, Verdict):
            self.requests[rid].commit(outcome.tokens)
        return outcome

    def check_layers(self, layers: tuple[int, ...]) -> None:
        """InvalidArgument("feature_layers") unless each is in [0, L]: layer i's input, or (L) the last hidden
        state, after the final norm (what the LM head reads: Medusa's)."""
        if any(not 0 <= i <= self.num_layers for i in layers):
            raise InvalidArgument("feature_layers", f"names layers {list(layers)}; the target has {self.num_layers} "
                                                    f"(ids in [0, {self.num_layers}])")

    def remove(self, leaving: list[Hashable]) -> None:
        gone = set(leaving)
        if not gone:
            return
        ending = [row for row, rid in enumerate(self.rows) if rid in gone]
        keep = compacting(len(self.rows), ending)
        # what they ran stays for prompts that begin the same way (a conversation's next turn)
        leaving_requests = [self.requests[self.rows[row]] for row in ending]
        self.lm.remember(ending, [r.seq for r in leaving_requests], [r.params.cache_salt for r in leaving_requests])
        for row, r in zip(ending, leaving_requests):
            if r.features and sum(f.shape[0] for f in r.features) == len(r.seq) - 1:
                self.lm.keep_features(row, r.seq, r.params.cache_salt, r.kept_layers, torch.cat(r.features))
        self.lm.select(keep)
        self.rows = [self.rows[row] for row in keep]
        for rid in gone:
            del self.requests[rid]

    def drop_all(self) -> None:
        """Every request leaves, begun or joined, and every row gives its blocks back, their KV forgotten: a
        failure outside a forward left the batch in a state nobody knows (the scheduler's loop recovers so)."""
        self.requests, self.rows, self._joining = {}, [], {}
        self.lm.reset(0)

    def prefix_stats(self) -> PrefixStats:
        """The block pool's counts: its prefix index's (all 0 when off) and the blocks used."""
        return self.lm.pool.stats()

    def forget_prefixes(self) -> int:
        """Empty the prefix index (BlockPool.forget) -> the tokens it held: later prompts prefill as on a fresh
        target. The rows running keep their blocks."""
        return self.lm.pool.forget()

    def last_token(self, rid: Hashable) -> int:
        return self.requests[rid].seq[-1]

    def refusal(self, rid: Hashable, tree: TokenTree, max_nodes: int | None = None) -> Exception | None:
        """Why this request's tree may not join a forward, or None: UnknownRequest for a request not in
        the batch; InvalidArgument for a tree not rooted at its last token, a token outside the
        vocabulary, more than `max_nodes` nodes past the root (what the request reserved), or a node past
        the model's context. (Proposals are checked where they cross the wire, actors/wire.py; a proposal
        that is no distribution fails its own row's acceptance at worst.)"""
        if rid not in self.requests:
            return UnknownRequest(f"request {rid!r} is not in the batch")
        seq = self.requests[rid].seq
        if tree.tokens[0] != seq[-1]:
            return InvalidArgument("tree.tokens", f"request {rid!r}: a tree's root must be its last token "
                                                  f"({seq[-1]}), got {tree.tokens[0]}")
        if max_nodes is not None and len(tree) - 1 > max_nodes:
            return InvalidArgument("tree.tokens", f"request {rid!r}: {len(tree) - 1} nodes past the root, "
                                                  f"over the {max_nodes} its KV reservation holds")
        if not 0 <= min(tree.tokens) <= max(tree.tokens) < self.vocab_size:
            return InvalidArgument("tree.tokens", f"request {rid!r}: a token id outside the vocabulary "
                                                  f"[0, {self.vocab_size})")
        if tree.proposals and tree.proposals[0].probs.device == HOST and (pid := self._past_vocabulary(tree)) is not None:
            return InvalidArgument("tree.proposals", f"request {rid!r}: proposal {pid} puts mass on ids past "
                                                     f"the target's vocabulary of {self.vocab_size}")
        if self.max_positions and len(seq) + tree.depth > self.max_positions:
            return InvalidArgument("tree.parents", f"request {rid!r}: the tree reaches position "
                                                   f"{len(seq) - 1 + tree.depth}, past the model's context of "
                                                   f"{self.max_positions} positions")
        return None

    def _past_vocabulary(self, tree: TokenTree) -> int | None:
        """The first proposal of the tree that puts more than rounding on ids past the vocabulary (a draft's
        padded vocabulary may be larger, never its mass), or None. Read where proposals arrive on the host
        (over the wire from another process), so it makes the device wait for nothing; a drafter in this
        process on a GPU (the engine's) is not checked: dense_proposals drops its mass past the vocabulary."""
        past = torch.stack([torch.where(q.ids >= self.vocab_size, q.probs, 0).sum() for q in tree.proposals])  # [P]
        (over,) = to_host(past > PROPOSAL_MASS_TOLERANCE)
        return next((pid for pid, bad in enumerate(over) if bad), None)

    @torch.inference_mode()
    def verify(self, trees: dict[Hashable, TokenTree], max_nodes: int | None = None, prefill: Sequence[int] = (),
               budget: int = 0) -> tuple[dict[Hashable, Outcome], int]:
        """Score the given requests' trees in one forward (other requests sit it out) and decide what
        each keeps. A tree refused (`refusal`) or a row whose acceptance fails gets its typed error
        instead of a verdict; the others are unaffected. `prefill`: begin's handles whose prompts run up
        to `budget` more tokens in the same forward, the oldest first (chunked prefill in a mixed batch;
        `remaining` says when one is done; with no trees, their chunks alone, in one forward of their own).
        -> outcomes by request id, tokens in the forward's block"""
        outcomes: dict[Hashable, Outcome] = {}
        for rid, tree in trees.items():
            if (error := self.refusal(rid, tree, max_nodes)) is not None:
                outcomes[rid] = error
        trees = {rid: tree for rid, tree in trees.items() if rid not in outcomes}
        riders = [self._joining[handle].prefilled for handle in prefill]
        shares = _share(riders, budget)
        if not trees and not any(chunk for _, _, chunk in shares):  # nothing to run (riders' prompts all in)
            return outcomes, 0
        ending = [i for i, (p, b, chunk) in enumerate(shares) if p.ends(b, len(chunk))]  # their last logits kept
        with self.lm.carrying(riders):
            ran, last, states = self._verify_rows(trees, outcomes, [chunk for _, _, chunk in shares], ending,
                                                  hidden=any(p.wants_features for p in riders))
        for i, row_logits in zip(ending, last):
            p, b, _ = shares[i]
            p.last[b] = row_logits
        ride = [len(chunk) for _, _, chunk in shares]
        first = ran - sum(ride)  # the riders' tokens follow the trees' nodes among the forward's hidden states
        for (p, b, chunk), start in zip(shares, itertools.accumulate([first, *ride[:-1]])):
            p.add_features(b, states, start, len(chunk))  # a head's prompt's, chunk by chunk as it rides
        for p in riders:
            p.ran()
        return outcomes, ran

    def _verify_rows(self, trees: dict[Hashable, TokenTree], outcomes: dict[Hashable, Outcome],
                     chunks: list[list[int]], ending: Sequence[int] = (),
                     hidden: bool = False) -> tuple[int, torch.Tensor, tuple[torch.Tensor, ...]]:
        """verify's forward and verdicts (into outcomes), the riders' chunks (one a row past the batch's own
        rows, each run as a chain and committed whole) along -> tokens run, the logits [len(ending), V]
        of the last token of each chunk `ending` names (the other riders' logits are not computed), and the
        forward's hidden states of every token [N, H] each (with hidden or a head's row among the trees; else ())"""
        row_trees = [trees.get(rid) or TokenTree.root(self.requests[rid].seq[-1]) for rid in self.rows]
        sizes = [len(trees[rid]) if rid in trees else 0 for rid in self.rows]  # rows not given a tree sit out
        chains = [TokenTree.chain(chunk) if chunk else TokenTree.root(0) for chunk in chunks]
        start, nodes = self.lm.size, sum(sizes)
        tokens, block, positions = layout(row_trees + chains, self.lm.lengths)
        ride = [len(chunk) for chunk in chunks]
        ends = list(itertools.accumulate(ride))
        keep = list(range(nodes)) + [nodes + ends[i] - 1 for i in ending] if any(ride) else None
        try:
            # a head's row, or one keeping features for a head's later rows: the layers' inputs too
            if hidden or any(self.requests[rid].kept_layers or self.requests[rid].feature_layers for rid in trees):
                logits, states = self.lm.forward_hidden(tokens, block, positions, sizes=sizes + ride, keep=keep)
            else:  # [N, V]: the trees' nodes, row after row
                logits, states = self.lm.forward(tokens, block, positions, sizes=sizes + ride, keep=keep), ()
        except Exception as e:
            if not any(ride):
                raise
            raise ChunksFailed(f"the forward failed with {sum(ride)} prompt tokens riding in it: {e}") from e
        logits, last = logits[:nodes], logits[nodes:]
        held, failed = self._processed(logits, row_trees, sizes)  # what p is drawn from (logprobs: the raw logits)
        (argmax,) = to_host(held.argmax(-1)) if nodes else ([],)  # the forward's one wait for the device (greedy rows)
        deciding = [i for i, rid in enumerate(self.rows) if rid in trees]  # rows not given a tree sat out
        bounds = [0, *itertools.accumulate(sizes)]
        decided = self._decide([self.rows[i] for i in deciding], [row_trees[i] for i in deciding],
                               [argmax[bounds[i] : bounds[i + 1]] for i in deciding],
                               [held[bounds[i] : bounds[i + 1]] for i in deciding],
                               [logits[bounds[i] : bounds[i + 1]] for i in deciding])
        outcome_of = dict(zip(deciding, decided)) | {i: failed[rid] for i, rid in enumerate(self.rows) if rid in failed}
        keep, keeping = [], {}  # keeping: plain rows' committed nodes whose features are kept for a head, by layers
        for i, rid in enumerate(self.rows):
            outcome = outcome_of.get(i)
            if isinstance(outcome, Verdict):
                r = self.requests[rid]
                r.commit(outcome.tokens)
                nodes_at = [bounds[i] + n for n in outcome.path]
                if r.feature_layers:
                    outcome.features = layer_features(states, r.feature_layers, nodes_at, self.lm)
                if r.features is not None:  # kept: the verdict's, or (a plain row's) at the head's layers
                    if r.kept_layers == r.feature_layers:
                        r.features.append(outcome.features)
                    else:
                        keeping.setdefault(r.kept_layers, []).append((r, nodes_at))
                keep.append([start + n for n in outcome.path])
            else:
                keep.append([])  # sat this step out, or failed: nothing committed
            if outcome is not None:
                outcomes[rid] = outcome
        for layers, rows in keeping.items():  # gathered for all such rows at once, then split
            gathered = layer_features(states, layers, [n for _, at in rows for n in at], self.lm)
            for (r, _), part in zip(rows, gathered.split([len(at) for _, at in rows])):
                r.features.append(part)
        self.lm.commit(keep + [list(range(start, start + n)) for n in ride])
        return nodes + sum(ride), last, states

    def _processed(self, logits: torch.Tensor, row_trees: list[TokenTree],
                   sizes: list[int]) -> tuple[torch.Tensor, dict[Hashable, InvalidArgument]]:
        """The forward's logits [N, V] after each node as its row's settings make them from the node's own
        history (specdec/processors.py); the same tensor when no row's settings change any. And the rows that
        cannot go on (their grammar failed): each fails alone, with its error, its logits left as they were."""
        parts, failed, held = logits.split(sizes), {}, []
        for rid, tree, part, size in zip(self.rows, row_trees, parts, sizes):
            try:
                held.append(self._row_logits(rid, tree, part) if size else part)
            except InvalidArgument as e:
                failed[rid] = e
                held.append(part)
        if all(h is part for h, part in zip(held, parts)):
            return logits, failed
        return torch.cat([h.float() for h in held]), failed

    def _row_logits(self, rid: Hashable, tree: TokenTree, logits: torch.Tensor) -> torch.Tensor:
        req = self.requests[rid]
        allowed = req.grammar.allowed(tree) if req.grammar is not None else None  # [size, V] on the host
        return process(logits, req.params, req.history, tree, allowed)

    def _decide(self, rids: list[Hashable], trees: list[TokenTree], argmax: list[list[int]],
                held: list[torch.Tensor], logits: list[torch.Tensor]) -> list[Outcome]:
        """What each row keeps (argmax: the argmax after each of its nodes; held: the logits [size, V] its tokens
        are drawn from; logits: the raw ones its logprobs are of), the sampled rows decided together; or
        RequestFailed for a row whose acceptance failed: that row alone ends (a NaN in its logits, say), the
        batch's other rows are decided as usual."""
        reqs = [self.requests[rid] for rid in rids]
        sampled = [i for i, req in enumerate(reqs) if not req.params.greedy]
        rows = [SampledRow(trees[i], held[i], reqs[i].params, reqs[i].generator) for i in sampled]
        try:
            drawn = dict(zip(sampled, accept_sampling(rows)))
        except Exception:  # noqa: BLE001 - a fault of one row's: decided alone, each row fails or not by itself
            log.exception("the batch's sampled verdicts failed; its %d sampled rows are decided one at a time", len(rows))
            drawn = {i: self._alone(row) for i, row in zip(sampled, rows)}
        return [self._verdict(rid, req, drawn[i] if i in drawn else accept_greedy(trees[i], argmax[i]), logits[i])
                for i, (rid, req) in enumerate(zip(rids, reqs))]

    @staticmethod
    def _verdict(rid: Hashable, req: _Request, v: Verdict | Exception, logits: torch.Tensor) -> Outcome:
        """A row's decided verdict with its logprobs, or RequestFailed when it failed."""
        if not isinstance(v, Exception):
            try:
                if req.params.logprobs is not None:
                    v.logprobs = committed_logprobs(logits, v.path, v.tokens, req.params.logprobs)
                return v
            except Exception as e:  # noqa: BLE001 - this row's fault is its own
                v = e
        log.error("request %s: its verdict failed; it ends alone", rid, exc_info=v)
        return RequestFailed("the target could not decide this request's tokens (its row failed in the "
                             "batched step; the other requests went on); see the server log")

    @staticmethod
    def _alone(row: SampledRow) -> Verdict | Exception:
        try:
            return accept_sampling([row])[0]
        except Exception as e:  # noqa: BLE001 - this row's fault is its own
            return e


def _share(riders: list[Prefilled], budget: int) -> list[tuple[Prefilled, int, list[int]]]:
    """The next chunks of these sequences being prefilled, up to `budget` tokens in all, the first ones first:
    (its Prefilled, its row there, the chunk) for every row of each (empty for a row whose turn has not come)."""
    shares = []
    for p in riders:
        take = p.next_chunks(budget)
        budget -= sum(map(len, take))
        shares += [(p, b, chunk) for b, chunk in enumerate(take)]
    return shares



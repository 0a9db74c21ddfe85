"""The target side of speculation: requests join and leave a running batch (continuous batching),
each keeping its own KV rows; the candidate trees of any of them are verified together in one
forward. It sees trees and sampling settings only, so the side that drafts can be another process."""

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from .acceptance import Verdict, accept_greedy, accept_sampling
from .errors import RequestExists, UnknownRequest
from .kvcache import CachedLM
from .logprobs import committed_logprobs
from .sampling import SamplingParams, make_generator
from .tree import TokenTree, layout


@dataclass
class _Request:
    seq: list[int]  # committed tokens; the cache holds all but the last, the root of the next tree
    params: SamplingParams
    generator: torch.Generator  # the target side's random stream (acceptance, bonus tokens)


class TargetWorker:
    def __init__(self, lm: CachedLM):
        self.lm = lm
        lm.reset(0)
        self.requests: dict[Hashable, _Request] = {}
        self.rows: list[Hashable] = []  # batch row -> request id

    def add(self, joining: list[tuple[Hashable, list[int], SamplingParams, int]]) -> None:
        """Requests (id, prompt, params, stream) join the batch; their prompts are prefilled in one forward
        of their own (the running rows are not padded along)."""
        for rid, prompt, _, _ in joining:
            if rid in self.requests:
                raise RequestExists(f"request {rid!r} is already in the batch")
            if not prompt:
                raise ValueError(f"request {rid!r}: the prompt is empty")
        self.lm.join([prompt[:-1] for _, prompt, _, _ in joining])  # the last token is the first tree's root
        for rid, prompt, params, stream in joining:
            gen = make_generator(params.seed, stream, self.lm.device, role="target")
            self.requests[rid] = _Request(list(prompt), params, gen)
            self.rows.append(rid)

    def remove(self, leaving: list[Hashable]) -> None:
        gone = set(leaving)
        keep = [row for row, rid in enumerate(self.rows) if rid not in gone]
        self.lm.select(keep)
        self.rows = [self.rows[row] for row in keep]
        for rid in gone:
            del self.requests[rid]

    def last_token(self, rid: Hashable) -> int:
        return self.requests[rid].seq[-1]

    def check(self, trees: dict[Hashable, TokenTree]) -> None:
        """UnknownRequest for a request not in the batch; ValueError for a tree not rooted at its last token."""
        for rid, tree in trees.items():
            if rid not in self.requests:
                raise UnknownRequest(f"request {rid!r} is not in the batch")
            if tree.tokens[0] != self.requests[rid].seq[-1]:
                raise ValueError(f"request {rid!r}: a tree's root must be its last token "
                                 f"({self.requests[rid].seq[-1]}), got {tree.tokens[0]}")

    @torch.inference_mode()
    def verify(self, trees: dict[Hashable, TokenTree]) -> tuple[dict[Hashable, Verdict], int]:
        """Score the given requests' trees in one forward (other requests sit it out) and decide what
        each keeps. -> verdicts by request id, tokens in the forward's block"""
        self.check(trees)
        if not trees:
            return {}, 0
        row_trees = [trees.get(rid) or TokenTree.root(self.requests[rid].seq[-1]) for rid in self.rows]
        sizes = [len(trees[rid]) if rid in trees else 0 for rid in self.rows]  # rows not given a tree sit out
        start = self.lm.size
        tokens, block, positions = layout(row_trees, self.lm.lengths)
        logits = self.lm.forward(tokens, block, positions, sizes=sizes)  # [N, V]: the trees' nodes, row after row
        argmax = logits.argmax(-1).tolist()
        verdicts, keep, offset = {}, [], 0
        for rid, tree, row_logits, size in zip(self.rows, row_trees, logits.split(sizes), sizes):
            row_argmax, offset = argmax[offset : offset + size], offset + size
            if rid not in trees:
                keep.append([])  # sat this step out: nothing committed
                continue
            req = self.requests[rid]
            v = accept_greedy(tree, row_argmax) if req.params.greedy else \
                accept_sampling(tree, row_logits, req.params, req.generator)
            if req.params.logprobs is not None:
                v.logprobs = committed_logprobs(row_logits, v.path, v.tokens, req.params.logprobs)
            req.seq += v.tokens
            verdicts[rid] = v
            keep.append([start + n for n in v.path])
        self.lm.commit(keep)
        return verdicts, sum(sizes)

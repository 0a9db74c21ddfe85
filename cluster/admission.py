"""Admission: a client's request (Request, whatever transport it came over) checked field by field,
tokenized, held to the model's context and the target's KV budget, and given a place under the ingress's
queue limit -> Admitted, the record the request is run from until its last chunk."""

import asyncio
import contextlib
import hashlib
import time
from dataclasses import dataclass, field, replace

from specdec.chat import encode_prompt
from specdec.errors import InvalidArgument, Unavailable
from specdec.grammar import Grammars, ResponseFormat, grammar_of
from specdec.sampling import MAX_LOGIT_BIAS, SamplingParams, check_cache_salt

from specdec.blocks import BLOCK_TOKENS
from specdec.scheduler import KvBudget

from . import metrics
from .config import ServeConfig, task_type_problem
from .detokenizer import check_stop
from .router import DEFAULT_TASK, Router, Speculation
from .statuses import QueueFull, event_of
from .supervisor import TargetSupervisor

# A prompt of more characters than max_prompt_tokens * MAX_CHARS_PER_TOKEN is refused before it is tokenized:
# it would fit only if its tokens were longer than this on average, which no subword vocabulary we know of
# comes near (their longest tokens are runs of spaces or punctuation of a few dozen characters). A word-level
# tokenizer that maps an unknown word of any length to one token is the exception: such prompts are refused.
MAX_CHARS_PER_TOKEN = 256
MAX_STOP_TOKEN_IDS = 64  # stop_token_ids a request may give
CONTEXT_EXCEEDED = "context_length_exceeded"  # OpenAI's code for a prompt and answer past the model's context


@dataclass(frozen=True)
class Request:
    """A client's request, transport aside (field names as in specdec_api.proto): what the gRPC converter
    (cluster/grpc_api.py) and the HTTP one (cluster/openai_api.py) make of a call."""

    prompt: str
    task_type: str = ""
    max_new_tokens: int | None = 16  # None: as many as server.max_new_tokens and the model's context allow
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    speculation: Speculation = Speculation.AUTO
    stop: tuple[str, ...] = ()  # generation ends once the text contains one of these (cut from it)
    n: int = 1  # independent samples of the prompt, each with its own random stream
    logprobs: int | None = None  # see SamplingParams
    add_special_tokens: bool = True  # False for a prompt that a chat template rendered with its own
    literal: tuple[tuple[int, int], ...] = ()  # prompt's character spans of a chat's own text (specdec.chat)
    min_p: float = 0.0  # see SamplingParams
    min_tokens: int = 0  # no end token, and no stop string, before this many tokens
    ignore_eos: bool = False  # the model's eos does not end it (it runs to max_new_tokens or a stop)
    stop_token_ids: tuple[int, ...] = ()  # these tokens end it too (as eos: finish_reason "stop")
    include_stop_str_in_output: bool = False  # the stop string (or end token's text) stays in the text
    skip_special_tokens: bool = True  # special tokens' texts are left out of the text
    repetition_penalty: float = 1.0  # see SamplingParams
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    response_format: ResponseFormat = ResponseFormat()  # the output is held to it (specdec/grammar.py)
    drafter: str = ""  # with speculation ON: the drafter kind to speculate with (one served); "": the router's
    prompt_token_ids: tuple[int, ...] = ()  # a prompt given as token ids (as completions take it): used as they are
    cache_salt: str | None = field(default=None, repr=False)  # see SamplingParams: whose cached work it may share
    tenant: str = field(default="", repr=False)  # set by the ingress, never by a client: its API key's scope

    def sampling(self, eos: list[int] = ()) -> SamplingParams:
        """Its sampling settings, with `eos` the model's end tokens (InvalidArgument naming the first bad field)."""
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.seed, self.logprobs, self.min_p,
                              self.min_tokens, self.end_ids(eos), self.repetition_penalty, self.presence_penalty,
                              self.frequency_penalty, self.logit_bias, grammar_of(self.response_format),
                              cache_salt=scoped_salt(self.tenant, self.cache_salt))

    def end_ids(self, eos: list[int]) -> tuple[int, ...]:
        """The tokens that end it: the model's eos unless ignore_eos, and its stop_token_ids."""
        return tuple(sorted(set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos))))


def scoped_salt(tenant: str, cache_salt: str | None) -> str | None:
    """The cache salt a request runs with: the client's own, or, within a tenant (an API key's scope), one that
    no other tenant's request can have, whatever salt it sends (a digest of both; InvalidArgument naming
    cache_salt for a bad one, checked first)."""
    if not tenant:
        return cache_salt
    check_cache_salt(cache_salt)
    inside = "" if cache_salt is None else "/" + cache_salt
    return "tenant-" + hashlib.sha256(f"{tenant}{inside}".encode()).hexdigest()


@dataclass
class Admitted:
    """A checked request: its prompt tokens and sampling settings as the actors take them."""

    request: Request  # with max_new_tokens set
    prompt_ids: list[int]
    params: SamplingParams
    task_type: str  # as routed and as the draft replicas take it: "" means the default thresholds
    admitted_at: float = field(default_factory=time.perf_counter)


class Admission:
    """The ingress's door: checks, tokenizes and counts the requests in flight (each sample holds a place
    until it ends: release)."""

    def __init__(self, cfg: ServeConfig, tokenizer, context: int | None, router: Router, budget: KvBudget,
                 supervisor: TargetSupervisor, eos: list[int] = ()):
        self.limits, self.tokenizer, self.context, self.eos = cfg.server, tokenizer, context, list(eos)
        self.router, self.budget, self.supervisor = router, budget, supervisor
        self.grammars = Grammars(tokenizer, None, eos)  # response_format's grammars checked here
        self.in_flight = 0  # samples admitted and not yet ended

    def admit(self, req: Request) -> Admitted:
        """Check every field (InvalidArgument names the first bad one), that the target group is up
        (Unavailable), and take a queue place (QueueFull). Tokenizes in the caller's thread: on the
        event loop, use admit_async."""
        with self._counted(req):
            self._check(req)
            return self._admitted(req, self._prompt_ids(req))

    async def admit_async(self, req: Request) -> Admitted:
        """admit, with the prompt tokenized in a worker thread: a long prompt holds up no other request's
        stream (the checks that need no tokens come first, and bound the prompt's length)."""
        with self._counted(req):
            self._check(req)
            ids = await asyncio.to_thread(self._prompt_ids, req)
            return self._admitted(req, ids)

    @property
    def most_samples(self) -> int:
        """The samples one request may run: each takes a queue place."""
        return min(self.limits.max_n, self.limits.max_queued_requests)

    def release(self) -> None:
        """A sample has ended: its place is free."""
        self.in_flight -= 1

    @contextlib.contextmanager
    def _counted(self, req: Request):
        """A refusal is counted under the name the router tracks the request's task type by already (Router.tracked;
        default for an invalid or untracked one)."""
        try:
            yield
        except (InvalidArgument, Unavailable, QueueFull) as e:
            name = DEFAULT_TASK if task_type_problem(req.task_type) else self.router.tracked(req.task_type or DEFAULT_TASK)
            metrics.count_event(name, event_of(e))
            raise

    def _routed_as(self, req: Request) -> str:
        """The name an admitted request's task type is routed and counted under (Router.fold: tracked from now on,
        or folded into default once routing.max_task_types names are)."""
        name = self.router.fold(req.task_type or DEFAULT_TASK)
        if name != (req.task_type or DEFAULT_TASK):
            metrics.task_types_folded().inc()
        return name

    def check_prompt_text(self, text: str, field: str) -> None:
        """InvalidArgument(field) for a text longer than a prompt of max_prompt_tokens tokens may be: checked before
        it is tokenized, which costs its length."""
        most = min(self.limits.max_request_bytes, self.limits.max_prompt_tokens * MAX_CHARS_PER_TOKEN)
        if len(text) > most:
            raise InvalidArgument(field, f"is {len(text)} characters, over the {most} that a prompt of "
                                         f"max_prompt_tokens {self.limits.max_prompt_tokens} tokens may have")

    def check_prompt_tokens(self, tokens: int, field: str) -> None:
        """InvalidArgument(field) for a prompt of more than max_prompt_tokens tokens."""
        if tokens > self.limits.max_prompt_tokens:
            raise InvalidArgument(field, f"is {tokens} tokens, over the limit of {self.limits.max_prompt_tokens}")

    def _check(self, req: Request) -> None:
        """The checks that need no tokens."""
        limits = self.limits
        if problem := task_type_problem(req.task_type):
            raise InvalidArgument("task_type", problem)
        if not req.prompt and not req.prompt_token_ids:
            raise InvalidArgument("prompt", "must not be empty")
        self.check_prompt_tokens(len(req.prompt_token_ids), "prompt")
        self.check_prompt_text(req.prompt, "prompt")
        if req.max_new_tokens is not None and not 0 < req.max_new_tokens <= limits.max_new_tokens:
            raise InvalidArgument("max_new_tokens", f"must be in 1..{limits.max_new_tokens}, got {req.max_new_tokens}")
        check_stop(req.stop)
        most_n = self.most_samples
        if not 1 <= req.n <= most_n:
            bound = ("server.max_n" if limits.max_n <= limits.max_queued_requests else
                     "server.max_queued_requests: a request of n samples takes n places in the queue")
            raise InvalidArgument("n", f"must be in 1..{most_n} ({bound}), got {req.n}")
        self._check_stop_token_ids(req.stop_token_ids)
        if req.max_new_tokens is not None and req.min_tokens > req.max_new_tokens:
            raise InvalidArgument("min_tokens", f"must be at most max_new_tokens ({req.max_new_tokens}), got {req.min_tokens}")
        self._check_logit_bias(req.logit_bias)
        self._check_response_format(req)
        self._check_drafter(req)
        req.sampling(self.eos)  # InvalidArgument naming the field (speculation is parsed by the converters)

    def _check_drafter(self, req: Request) -> None:
        """A drafter asked for is one the draft replicas run, and comes with speculation ON."""
        if not req.drafter:
            return
        served, allowed = [str(kind) for kind in self.router.shapes], self.router.drafters_for(req.task_type)
        if req.drafter not in served:
            named = repr(req.drafter) if len(req.drafter) <= 40 else f"a name of {len(req.drafter)} characters"
            raise InvalidArgument("drafter", f"{named} is not served here; the draft replicas run "
                                             f"{', '.join(served) if served else 'none (this server does not speculate)'}")
        if req.drafter not in allowed:
            raise InvalidArgument("drafter", f"{req.drafter!r} is not allowed for task type {req.task_type!r} by the "
                                             f"server's routing; allowed: {', '.join(map(str, allowed))}")
        if req.speculation != Speculation.ON:
            raise InvalidArgument("drafter", f"needs speculation ON (got {req.speculation}): AUTO requests speculate "
                                             "with the router's choice, OFF ones not at all")

    def _check_logit_bias(self, bias: tuple[tuple[int, float], ...]) -> None:
        if len(bias) > MAX_LOGIT_BIAS:  # before listing any: the message names a few ids, never a body's worth
            raise InvalidArgument("logit_bias", f"at most {MAX_LOGIT_BIAS} token ids, got {len(bias)}")
        self._check_in_vocabulary("logit_bias", [t for t, _ in bias])

    def _check_in_vocabulary(self, name: str, ids) -> None:
        """InvalidArgument naming `name` (and a few of the ids, never a body's worth) unless every id is a token's."""
        if outside := sorted({t for t in ids if not 0 <= t < len(self.tokenizer)}):
            raise InvalidArgument(name, f"token ids must be in the vocabulary [0, {len(self.tokenizer)}), "
                                        f"got {outside[:8]}{' and more' if len(outside) > 8 else ''}")

    def _check_response_format(self, req: Request) -> None:
        """A response format's grammar ends in the model's eos, so it asks for eos to end the row, and
        for no min_tokens that would hold it back past where the grammar ends."""
        if req.response_format.type in ("", "text"):
            return
        if req.ignore_eos:
            raise InvalidArgument("response_format", "cannot be used with ignore_eos: the output ends when it "
                                                     "is complete, with the model's eos")
        if req.min_tokens:
            raise InvalidArgument("response_format", "cannot be used with min_tokens: the output ends when it "
                                                     "is complete, however few tokens that is")

    def _check_stop_token_ids(self, ids: tuple[int, ...]) -> None:
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgument("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
        if any(not 0 <= t < len(self.tokenizer) for t in ids):
            raise InvalidArgument("stop_token_ids", f"token ids must be in the vocabulary [0, {len(self.tokenizer)}), "
                                                    f"got {list(ids)}")

    def _prompt_ids(self, req: Request) -> list[int]:
        """The prompt's tokens; and a response format's grammar checked against the tokenizer (both take
        CPU time: admit_async runs this off the event loop)."""
        if (grammar := grammar_of(req.response_format)) is not None:
            self.grammars.check(grammar)
        if req.prompt_token_ids:
            self._check_in_vocabulary("prompt", req.prompt_token_ids)
            return list(req.prompt_token_ids)
        return encode_prompt(self.tokenizer, req.prompt, req.literal, req.add_special_tokens)

    def _admitted(self, req: Request, ids: list[int]) -> Admitted:
        limits = self.limits
        if not ids:
            raise InvalidArgument("prompt", "encodes to no tokens")
        self.check_prompt_tokens(len(ids), "prompt")
        max_new_tokens = req.max_new_tokens or self._room(len(ids))
        if req.min_tokens > max_new_tokens:
            raise InvalidArgument("min_tokens", f"is {req.min_tokens}, over the {max_new_tokens} new tokens this "
                                                "prompt leaves room for")
        if self.context and len(ids) + max_new_tokens > self.context:
            raise InvalidArgument("prompt", f"{len(ids)} prompt tokens + max_new_tokens {max_new_tokens} exceed "
                                           f"the model's context of {self.context} tokens", CONTEXT_EXCEEDED)
        if (cost := self.budget.cost(len(ids), max_new_tokens)) > self.budget.max_tokens:
            held = (f"{len(ids)} prompt tokens + max_new_tokens {max_new_tokens} + {self.budget.tree_room} for a tree"
                    if self.budget.window is None else
                    f"the larger of {len(ids)} prompt tokens and the model's window of {self.budget.window} + "
                    f"{self.budget.tree_room} for a tree + {2 * BLOCK_TOKENS} of blocks partly behind it")
            raise InvalidArgument("max_new_tokens" if req.max_new_tokens else "prompt",
                                  f"{held} = {cost} KV tokens, over the target's max_kv_tokens {self.budget.max_tokens}")
        self.supervisor.check()
        if self.in_flight + req.n > limits.max_queued_requests:
            raise QueueFull(f"{self.in_flight} requests are queued or running (max_queued_requests "
                            f"{limits.max_queued_requests}, a request of n samples takes n); retry later")
        self.in_flight += req.n  # each sample gives its place back as it ends (release)
        task_type = self._routed_as(req)
        return Admitted(replace(req, max_new_tokens=max_new_tokens), ids, req.sampling(self.eos),
                        "" if task_type == DEFAULT_TASK else task_type)

    def _room(self, prompt_tokens: int) -> int:
        """The most new tokens a request may ask for after this prompt: within the model's context and the
        target's KV budget (at least 1)."""
        room = self.context - prompt_tokens if self.context else self.limits.max_new_tokens
        most = self.limits.max_new_tokens
        fits = self.budget.cost(prompt_tokens, most) <= self.budget.max_tokens  # a model with a window may hold any
        kv_room = most if fits else self.budget.max_tokens - self.budget.cost(prompt_tokens, 0)
        return max(1, min(room, kv_room, most))

"""Sampling parameters and the logits warping applied alike to target (p) and draft (q)."""

import math
import struct
from dataclasses import dataclass, field

import torch

from .errors import InvalidArgument
from .logprobs import MAX_LOGPROBS

# Below this a temperature is refused, not sampled (vLLM and SGLang treat it as greedy: _SAMPLING_EPS):
# the distribution it asks for is the argmax up to float32 rounding, so a client means 0 (greedy).
MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = float(torch.finfo(torch.float32).max)  # the wire carries float32: beyond it is inf
MAX_TOP_K = 2**31 - 1  # the wire's int32
SEED_RANGE = range(-(2**63), 2**63)  # the wire's int64
MAX_REPETITION_PENALTY = 100.0  # past it every seen token's logit is scaled to about 0: no model needs more
MIN_REPETITION_PENALTY = 1 / MAX_REPETITION_PENALTY  # below it a seen token's logit is scaled past float32's range
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2] (OpenAI's range, and vLLM's)
MAX_BIAS = 100.0  # a logit_bias value lies in [-100, 100] (OpenAI's range)
MAX_LOGIT_BIAS = 300  # ids a logit_bias may name (OpenAI's limit): it travels with every Open on the wire
MAX_GRAMMAR_BYTES = 256 * 1024  # a response_format's grammar: travels with every Open on the wire
MAX_CACHE_SALT = 256  # characters of a cache_salt: it is kept with every cached prefix's first block


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks tokens. temperature == 0 means greedy decoding."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int | None = None  # None: none; k: the target's logprob of each token and of its k likeliest
    min_p: float = 0.0  # 0: off; else a token less likely than min_p times the likeliest one is never drawn
    min_tokens: int = 0  # the row's first min_tokens tokens are never one of end_ids (held out of p, as vLLM)
    end_ids: tuple[int, ...] = ()  # the tokens that end the row (eos unless ignored, and stop_token_ids)
    # What the target's logits after a token depend on besides the model (specdec/processors.py), by vLLM's
    # names and meanings: each tree node's are computed from its own path.
    repetition_penalty: float = 1.0  # 1: off; a token seen in the prompt or output has its logit divided by it (x if < 0)
    presence_penalty: float = 0.0  # subtracted from the logit of every token the output holds
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to its logit, ids distinct
    grammar: str | None = None  # an llguidance grammar (specdec/grammar.py) the output must match; None: any
    # Not how tokens are picked but whose cached work the request may share, carried with the rest to every actor:
    # it reuses the prefix cache's KV (target's and drafts') of requests with the same salt only, and its suffix
    # drafts read only their outputs; None: shares with every request that has none (vLLM's cache_salt, against
    # clients that time their requests, or read their acceptance, to learn what others' prompts and outputs hold).
    cache_salt: str | None = field(default=None, repr=False)  # a client's secret, as a key is: kept out of reprs

    def __post_init__(self):
        """The one check of sampling fields, wherever they come from (CLI, gRPC, HTTP, another actor). The floats
        are checked as the wire carries them (float32): a value the ingress accepts, its target accepts too."""
        temperature = as_float32(self.temperature)
        if not (temperature == 0 or as_float32(MIN_TEMPERATURE) <= temperature <= MAX_TEMPERATURE):  # NaN fails too
            raise InvalidArgument("temperature", f"must be 0 (greedy) or a number in [{MIN_TEMPERATURE}, "
                                                 f"{MAX_TEMPERATURE:.4g}], got {self.temperature}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise InvalidArgument("top_k", f"must be in 0..{MAX_TOP_K} (0 turns it off), got {self.top_k}")
        if not 0 < as_float32(self.top_p) <= 1:  # NaN fails this too
            raise InvalidArgument("top_p", f"must be in (0, 1] (and not 0 as a 32-bit float), got {self.top_p}")
        if self.seed is not None and self.seed not in SEED_RANGE:
            raise InvalidArgument("seed", f"must be a 64-bit signed integer, got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidArgument("logprobs", f"must be in 0..{MAX_LOGPROBS} (or unset), got {self.logprobs}")
        if not 0 <= self.min_p <= 1:  # NaN fails this too
            raise InvalidArgument("min_p", f"must be in [0, 1] (0 turns it off), got {self.min_p}")
        if not 0 <= self.min_tokens <= MAX_TOP_K:
            raise InvalidArgument("min_tokens", f"must be in 0..{MAX_TOP_K}, got {self.min_tokens}")
        if any(not 0 <= t <= MAX_TOP_K for t in self.end_ids):
            raise InvalidArgument("stop_token_ids", f"token ids must be in 0..{MAX_TOP_K}, got {list(self.end_ids)}")
        self._check_processors()

    def _check_processors(self) -> None:
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:  # NaN fails this too
            raise InvalidArgument("repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY:g}, "
                                                        f"{MAX_REPETITION_PENALTY:g}] (1 turns it off), got "
                                                        f"{self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise InvalidArgument(name, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 turns it off), "
                                            f"got {getattr(self, name)}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidArgument("logit_bias", f"at most {MAX_LOGIT_BIAS} token ids, got {len(self.logit_bias)}")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise InvalidArgument("logit_bias", "names a token id twice")
        for token, bias in self.logit_bias:
            if not 0 <= token <= MAX_TOP_K:
                raise InvalidArgument("logit_bias", f"token ids must be in 0..{MAX_TOP_K}, got {token}")
            if not -MAX_BIAS <= bias <= MAX_BIAS:
                raise InvalidArgument("logit_bias", f"biases must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {bias} "
                                                    f"for token {token}")
        check_cache_salt(self.cache_salt)
        if self.grammar is not None and len(self.grammar.encode()) > MAX_GRAMMAR_BYTES:
            raise InvalidArgument("response_format", f"its grammar is {len(self.grammar.encode())} bytes, over "
                                                     f"the limit of {MAX_GRAMMAR_BYTES}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def warp_settings(self) -> tuple[float, int, float, float]:
        """What warp reads: rows alike in these are warped as one."""
        return self.temperature, self.top_k, self.top_p, self.min_p

    @property
    def penalized(self) -> bool:
        """Whether the target's logits after a node depend on the tokens before it (the penalties)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def as_float32(x: float) -> float:
    """x as a 32-bit float holds it (the wire's precision: protos/specdec_tree.proto): inf past its range."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits [..., V] into the sampling distribution [..., V] (float32): warp_'s weights, normalised."""
    w = warp_(logits.to(torch.float32, copy=True), params)
    return w / w.sum(-1, keepdim=True)


def warp_(x: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits x [..., V] (float32) in place into the sampling distribution's weights, unnormalised (the
    likeliest token's 1) -> x: temperature, min-p, top-k, top-p (vLLM's order). The logits are shifted by
    their maximum before the division, so no temperature overflows them: the likeliest token is at 0, the
    others at or below it (-inf at worst), and exp stays finite; min-p drops a token whose probability is
    under min_p times the likeliest's, i.e. whose shifted logit is under log(min_p). In place, as the
    sampled verify's distributions are the size of the vocabulary for every node of every row: each pass
    over them costs, and each new buffer of them more (its pages are faulted in on the host)."""
    assert not params.greedy, "greedy decoding takes the argmax; there is no distribution to warp"
    x.sub_(x.amax(-1, keepdim=True))
    if params.temperature != 1:
        x.div_(params.temperature)
    if params.min_p > 0:
        x.masked_fill_(x < math.log(params.min_p), float("-inf"))
    if params.top_k and params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x.masked_fill_(x < kth, float("-inf"))
    x.exp_()
    if params.top_p < 1:
        ranked, order = x.sort(dim=-1, descending=True)
        # drop a token when the tokens ranked above it already reach top_p of the whole
        drop = (ranked.cumsum(-1) - ranked) >= params.top_p * x.sum(-1, keepdim=True)
        drop[..., 0] = False  # the likeliest token stays, however small top_p (its product may round to 0)
        x.scatter_(-1, order, ranked.masked_fill_(drop, 0.0))
    return x


ROLES = ("draft", "target")  # the two sides draw from separate streams, as they may run in separate processes


def make_generator(
    seed: int | None, stream: int = 0, device: str | torch.device = "cpu", role: str = "draft"
) -> torch.Generator:
    """A generator for one request's random stream; `stream` separates the samples of one seed and
    `role` the draft side's draws from the target side's."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(((seed * 1_000_003 + stream) * len(ROLES) + ROLES.index(role)) % (2**63))
    return g


def check_cache_salt(salt) -> None:
    """InvalidArgument("cache_salt") unless it is None or a non-empty string of at most MAX_CACHE_SALT characters."""
    if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT):
        raise InvalidArgument("cache_salt", f"must be a non-empty string of at most {MAX_CACHE_SALT} characters "
                                            f"(or unset), got {_shown(salt)}")


def _shown(value) -> str:
    """A refused value as an error message shows it: a long one cut."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}... ({len(value) if isinstance(value, str) else '?'} characters)"

"""The one converter between specdec.v1.SpecDecode's messages (protos/specdec_api.proto) and the ingress's
records: a GenerateRequest -> Request, a chunk or a whole sample -> GenerateResponse, /v1/stats's
sections -> GetStatsResponse. (The HTTP API's is cluster/openai_api.py.)"""

import json

from protos import specdec_api_pb2 as api
from specdec.errors import InvalidArgument
from specdec.grammar import ResponseFormat
from specdec.logprobs import TokenLogprob

from actors import wire

from .admission import Request
from .detokenizer import token_text
from .frontend import IngressStats
from .relay import Chunk, SpeculationStats
from .router import Speculation
from .samples import Sample


def request_from_proto(msg: api.GenerateRequest) -> Request:
    """The request as the frontend admits it (its fields are checked there); InvalidArgument for a
    speculation number the enum does not name (proto3 enums take any)."""
    try:
        speculation = Speculation.parse(api.Speculation.Name(msg.speculation))
    except ValueError:
        raise InvalidArgument("speculation", f"must be one of {', '.join(api.Speculation.keys())}") from None
    return Request(prompt=msg.prompt, task_type=msg.task_type, max_new_tokens=msg.max_new_tokens,
                   speculation=speculation, stop=tuple(msg.stop), n=msg.n or 1, ignore_eos=msg.ignore_eos,
                   stop_token_ids=tuple(msg.stop_token_ids), include_stop_str_in_output=msg.include_stop_str_in_output,
                   skip_special_tokens=msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True,
                   response_format=response_format_from_proto(msg.response_format), drafter=msg.drafter,
                   **wire.sampling_fields(msg))


def response_format_from_proto(msg: api.ResponseFormat) -> ResponseFormat:
    """InvalidArgument when json_schema is not JSON text (what it holds is checked at admission)."""
    if not msg.json_schema:
        return ResponseFormat(msg.type)
    try:
        return ResponseFormat(msg.type, json.loads(msg.json_schema))
    except RecursionError:
        raise InvalidArgument("response_format.json_schema", "nests too deeply to read") from None
    except ValueError as e:  # not JSON, or a number past Python's digit limit
        raise InvalidArgument("response_format.json_schema", f"is not JSON: {e}") from None


class Responses:
    """GenerateResponses of a request's chunks or samples; token texts from the target's tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def chunk(self, index: int, chunk: Chunk) -> api.GenerateResponse:
        return api.GenerateResponse(index=index, text=chunk.text, token_ids=chunk.token_ids,
                                    finish_reason=chunk.finish_reason or "",
                                    stats=stats_proto(chunk.stats) if chunk.finish_reason else None,
                                    logprobs=self._logprobs(chunk.logprobs))

    def sample(self, s: Sample) -> api.GenerateResponse:
        return api.GenerateResponse(index=s.index, text=s.text, token_ids=s.token_ids, finish_reason=s.finish_reason,
                                    stats=stats_proto(s.stats), logprobs=self._logprobs(s.logprobs))

    def _logprobs(self, entries: list[TokenLogprob]) -> list[api.TokenLogprob]:
        def one(token: int, logprob: float, top=()) -> api.TokenLogprob:
            return api.TokenLogprob(token_id=token, token=token_text(self.tokenizer, token), logprob=logprob,
                                    top=[one(t, lp) for t, lp in top])

        return [one(e.token, e.logprob, e.top) for e in entries]


def stats_proto(stats: SpeculationStats) -> api.SpeculationStats:
    return api.SpeculationStats(speculative=stats.speculative, drafted=stats.drafted, accepted=stats.accepted,
                                steps=stats.steps, alpha=stats.alpha, tried=stats.tried)


def stats_response(stats: IngressStats) -> api.GetStatsResponse:
    return api.GetStatsResponse(task_types=[
        api.TaskTypeStats(task_type=name, alpha=s.alpha, decision=s.decision, k=s.k, samples=s.samples,
                          requests=s.requests, reason=s.reason, goodput=s.goodput or {}, drafter=s.drafter,
                          drafters={kind: api.DrafterStats(alpha=d.alpha, samples=d.samples, goodput=d.goodput)
                                    for kind, d in s.drafters.items()})
        for name, s in stats.task_types.items()], target=_target_proto(stats.target), in_flight=stats.in_flight)


def _target_proto(target: dict) -> api.TargetStats:
    """/v1/stats's target section as GetStats's TargetStats (unknown counts, while it is down, left unset)."""
    return api.TargetStats(**{key: value for key, value in target.items() if value is not None})

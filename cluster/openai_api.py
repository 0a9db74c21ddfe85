"""OpenAI's HTTP API over the Frontend, as the official clients call it: GET /v1/models, POST
/v1/completions and /v1/chat/completions (whole or streamed, with n, stop, logprobs and usage in
streams). OpenAI fields that specdec does not implement are refused by name; the implicit defaults
that clients send for them are accepted. Every error has OpenAI's shape."""

import asyncio
import json
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from itertools import accumulate
from typing import Annotated, Literal, TypeVar, get_args

from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from specdec.chat import ChatPrompt, encode_prompt, render_chat
from specdec.errors import InvalidArgument
from specdec.grammar import ResponseFormat
from specdec.logprobs import TokenLogprob

from .detokenizer import token_bytes, token_text
from .admission import Admitted, Request
from .frontend import Frontend
from .relay import Chunk
from .router import Speculation
from .samples import Sample, gather_samples, run_samples
from .statuses import RequestTooLarge, client_error

# OpenAI fields that change nothing specdec returns (where to store it, tags, a billing tier, tool calls in parallel
# when no tools are served): accepted and ignored, as vLLM does.
IGNORED = ("store", "metadata", "service_tier", "parallel_tool_calls")
# OpenAI fields specdec does not implement -> the values that leave them unused (null always does).
UNSUPPORTED = {
    "best_of": (1,), "suffix": ("",), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
    "function_call": ("none",),
}


class HttpError(Exception):
    """An error response in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)

    @classmethod
    def of(cls, error: BaseException) -> "HttpError":
        """Any error as a client sees it (cluster/statuses.py): a typed one's status and message, anything
        else 500 with a generic message (the error logged under the id it names)."""
        if isinstance(error, HttpError):
            return error
        seen = client_error(error)
        return cls(seen.status.http, seen.message, seen.param, seen.status.kind)


# --- the request body ----------------------------------------------------------------------------------


async def read_body(http, limit: int) -> bytes:
    """An HTTP request's body (a Starlette request), read in chunks and never past `limit` bytes
    (server.max_request_bytes): a Content-Length over it is refused before anything is read, a body that
    outgrows it (chunked, or longer than it said) as soon as it does. RequestTooLarge (413) either way."""
    too_large = RequestTooLarge(f"body: is over the limit of {limit} bytes (server.max_request_bytes)")
    length = http.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise too_large
    body = bytearray()
    async for chunk in http.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


def _json_int(digits: str) -> int:
    """A JSON integer; one too long for Python to convert (over sys.get_int_max_str_digits(): 4300) stands
    as +-10**4300, beyond every bound of a field, so it is refused naming its field, not as a broken body."""
    most = sys.get_int_max_str_digits()
    if most and len(digits.lstrip("-")) > most:
        return -_HUGE if digits.startswith("-") else _HUGE
    return int(digits)


_HUGE = 10**4300
# The integers a body may carry: int64, the widest the gRPC API takes (specdec_api.proto); each field's own
# range is checked where the field is (the frontend, SamplingParams), with its own message.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


# --- request bodies ---------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False  # a last event with the usage (and no choices) before [DONE]
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every event carries the usage so far


class JsonSchema(BaseModel):
    """response_format.json_schema, as OpenAI's: the schema and its name (strict and description are
    accepted: the output always matches the schema)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = "response"
    schema_: dict = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormatBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> "ResponseFormatBody":
        if (self.json_schema is not None) != (self.type == "json_schema"):
            raise ValueError("json_schema is given with type json_schema, and only with it")
        return self

    def record(self) -> ResponseFormat:
        return ResponseFormat(self.type, self.json_schema.schema_ if self.json_schema else None)


TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,11}")


def logit_bias_of(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias (token ids as JSON keys) -> (id, bias) pairs by id; InvalidArgument for a key that
    is no integer (the ranges are checked with the other sampling fields)."""
    pairs = []
    for key, value in (bias or {}).items():
        if not TOKEN_ID_KEY.fullmatch(key):  # ASCII digits only: "²" is a digit to str.isdigit, not to int()
            raise InvalidArgument("logit_bias", f"keys are token ids, got {key[:32]!r}")
        pairs.append((int(key), value))
    return tuple(sorted(pairs))


class _Body(BaseModel):
    """The fields both endpoints take: OpenAI's that specdec serves, plus task_type, speculation, top_k."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None  # the served model's name, or none (check_model)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Int64 = 0  # 0 turns it off, and so does -1 (vLLM's "off", which clients written for it send)
    seed: Int64 | None = None
    n: Int64 = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored
    task_type: str = ""
    speculation: Annotated[Speculation, BeforeValidator(Speculation.parse)] = Speculation.AUTO
    drafter: str = ""  # with speculation ON: the drafter kind to speculate with (specdec's, as task_type)
    max_completion_tokens: Int64 | None = None  # OpenAI's newer name for max_tokens; wins when both are set
    # vLLM's extra fields (its SamplingParams' names and meanings)
    min_p: float = 0.0
    min_tokens: Int64 = 0
    ignore_eos: bool = False
    stop_token_ids: list[Int64] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0
    # OpenAI's penalties and constraints (done exactly under speculation: specdec/processors.py)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormatBody | None = None
    cache_salt: str | None = None  # vLLM's: shares cached prompts (and suffix drafts' outputs) only with this salt's

    @field_validator("stream_options")
    @classmethod
    def _only_with_stream(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return options

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage and \
            self.stream_options.continuous_usage_stats

    def max_tokens_field(self) -> str:
        """The body's name for the request's max_new_tokens."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def request(self, prompt: str | list[int], logprobs: int | None, **more) -> Request:
        """prompt: text, or token ids (used as they are)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        max_new_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        text, ids = (prompt, ()) if isinstance(prompt, str) else ("", tuple(prompt))
        return Request(prompt=text, prompt_token_ids=ids, task_type=self.task_type, max_new_tokens=max_new_tokens,
                       temperature=self.temperature, top_k=0 if self.top_k == -1 else self.top_k, top_p=self.top_p, seed=self.seed,
                       speculation=self.speculation, drafter=self.drafter, stop=stop, n=self.n, logprobs=logprobs, min_p=self.min_p,
                       min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
                       stop_token_ids=tuple(self.stop_token_ids or ()),
                       include_stop_str_in_output=self.include_stop_str_in_output,
                       skip_special_tokens=self.skip_special_tokens, repetition_penalty=self.repetition_penalty,
                       presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                       logit_bias=logit_bias_of(self.logit_bias),
                       response_format=self.response_format.record() if self.response_format else ResponseFormat(),
                       cache_salt=self.cache_salt, **more)


def _token_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int and 0 <= t < 2**31 for t in value)


class CompletionBody(_Body):
    """POST /v1/completions. prompt, as OpenAI and vLLM take it: a text, token ids, or a list of either (several
    prompts: the choices of prompt k are k * n .. k * n + n - 1)."""

    prompt: str | list[str] | list[int] | list[list[int]]  # checked by _prompt_shape first
    max_tokens: Int64 | None = 16  # null: up to server.max_new_tokens and the model's context
    logprobs: Int64 | None = None  # the chosen token's logprob and the `logprobs` likeliest tokens' at each position
    echo: bool = False  # the prompt before the completion's text

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, prompt: object) -> object:
        if isinstance(prompt, str) or _token_ids(prompt) or (isinstance(prompt, list) and prompt and (
                all(isinstance(p, str) for p in prompt) or all(_token_ids(p) for p in prompt))):
            return prompt
        raise ValueError("must be a text, token ids (0 <= id < 2^31), or a non-empty list of texts or of token ids")

    def prompts(self) -> list[str | list[int]]:
        """Each prompt the body gives: a text or token ids."""
        one = isinstance(self.prompt, str) or isinstance(self.prompt[0], int)
        return [self.prompt] if one else list(self.prompt)

    @field_validator("echo")
    @classmethod
    def _not_with_logprobs(cls, echo: bool, info: ValidationInfo) -> bool:
        if echo and info.data.get("logprobs") is not None:
            raise ValueError("with logprobs is not supported by specdec (it does not compute the prompt's logprobs)")
        return echo


def text_of_parts(content: object) -> object:
    """A message's content as one string: a list of content parts ([{"type": "text", "text": ...}]) joined
    by newlines (as vLLM); a part of another type is refused naming it (specdec serves text models)."""
    if not isinstance(content, list):
        return content
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ValueError(f"part {i} is of type {kind!r}: only text parts ({{\"type\": \"text\", \"text\": "
                             f"...}}) are served (specdec serves text-only models)")
        if not isinstance(part.get("text"), str) or part.keys() - {"type", "text"}:
            raise ValueError(f"part {i}: a text part is {{\"type\": \"text\", \"text\": <string>}}")
        texts.append(part["text"])
    return "\n".join(texts)


ROLE = r"^[A-Za-z_][A-Za-z0-9_-]{0,31}$"  # system, user, assistant, tool, developer, ipython...: a name, no markup


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Annotated[str, Field(pattern=ROLE)]  # templates paste it into their markup: never free text
    content: Annotated[str, BeforeValidator(text_of_parts)]  # a string, or a list of text parts
    name: str | None = None


class ChatBody(_Body):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None  # unset: up to server.max_new_tokens and the model's context
    logprobs: bool = False
    top_logprobs: Int64 | None = None  # with logprobs: the likeliest tokens' logprobs at each position

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return top


class TokenizeBody(BaseModel):
    """POST /tokenize, as vLLM: a prompt (as /v1/completions tokenizes it) or chat messages (as
    /v1/chat/completions renders them)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # unset: true for a prompt, false for messages (their template has its own)
    add_generation_prompt: bool = True  # with messages: end with the assistant's turn, as chat completions do
    return_token_strs: bool = False  # each token's own text too

    def text_field(self) -> str:
        """Which of prompt and messages it gives (HttpError unless exactly one)."""
        if (self.messages is None) == (self.prompt is None):
            raise HttpError(400, "prompt: give either prompt or messages, not both or neither", "prompt")
        return "prompt" if self.messages is None else "messages"


class DetokenizeBody(BaseModel):
    """POST /detokenize, as vLLM."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[Int64]


Body = TypeVar("Body", bound=BaseModel)


def unpaired_surrogate(data: dict) -> str | None:
    """A field of a parsed body (a dotted path, as pydantic names them; "body" for a key) whose text holds an
    unpaired UTF-16 surrogate, else None. JSON lets "\\ud800" stand alone; Python decodes it to a
    str that no tokenizer encodes (nor UTF-8)."""
    stack: list[tuple[str, object]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str) and not _is_unicode(value):
            return path
        if isinstance(value, dict):
            if not all(map(_is_unicode, value)):
                return "body"
            stack += [(f"{path}.{k}" if path else k, v) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(f"{path}.{i}", v) for i, v in enumerate(value)]
    return None


def _is_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


PARSE_OFF_LOOP_BYTES = 64 << 10  # a body this large is read in a worker thread: up to max_request_bytes of JSON
# (a 4 MiB list of tiny chat messages: about a second) would hold up every other stream on the event loop


async def parsed(raw: bytes, model: type[Body]) -> Body:
    """parse_body, off the event loop for a large body."""
    if len(raw) > PARSE_OFF_LOOP_BYTES:
        return await asyncio.to_thread(parse_body, raw, model)
    return parse_body(raw, model)


def parse_body(raw: bytes, model: type[Body]) -> Body:
    """The body as JSON whatever its content type (curl -d sends a form type); HttpError naming the field."""
    try:
        data = json.loads(raw, parse_int=_json_int)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise HttpError(400, "body: is not valid JSON", "body") from None
    except RecursionError:
        raise HttpError(400, "body: nests too deep", "body") from None
    if not isinstance(data, dict):
        raise HttpError(400, "body: must be a JSON object", "body")
    if (field := unpaired_surrogate(data)) is not None:
        raise HttpError(400, f"{field}: holds an unpaired UTF-16 surrogate (a \\ud800-\\udfff escape alone), "
                             "which is not Unicode text", field)
    for name, unused in UNSUPPORTED.items():
        value = data.pop(name, None)
        if value is not None and value not in unused:
            raise HttpError(400, f"{name} is not supported by specdec", name)
    for name in IGNORED:
        data.pop(name, None)
    try:
        return model.model_validate(_nulls_unset(data, model))
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(part) for part in err["loc"])
        if err["type"] == "extra_forbidden":
            reason = f"is not a field specdec knows (it takes {', '.join(model.model_fields)})"
        else:
            reason = str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"]
        raise HttpError(400, f"{field}: {reason}", field) from None


def _nulls_unset(data: dict, model: type[BaseModel]) -> dict:
    """The body with null dropped where its field takes no null: OpenAI's clients send null for a field they
    leave at its default (temperature, n, stream...), and OpenAI and vLLM take it so."""
    fields = model.model_fields
    return {k: v for k, v in data.items()
            if not (v is None and k in fields and type(None) not in get_args(fields[k].annotation))}


# --- responses ---------------------------------------------------------------------------------------


class _Completions:
    """/v1/completions choices: text, and logprobs as tokens, token_logprobs, top_logprobs, text_offset."""

    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, piece: Callable[[int], str], body: CompletionBody, echoes: list[str] | None = None):
        """echoes: with echo, each prompt's text (choice k * n + i is prompt k's)."""
        self.piece, self.logprobs, self.n = piece, body.logprobs is not None, body.n
        self.echoes = echoes or []
        self.offsets: dict[int, int] = {}  # sample -> its next token's text_offset
        self.started: set[int] = set()

    def echo(self, index: int) -> str:
        return self.echoes[index // self.n] if self.echoes else ""

    def choice(self, s: Sample) -> dict:
        return {"index": s.index, "text": self.echo(s.index) + s.text, "token_ids": s.token_ids,
                "finish_reason": s.finish_reason, "logprobs": self._logprobs(s.index, s.logprobs)}

    def chunk_choice(self, index: int, chunk: Chunk) -> dict:
        echo = "" if index in self.started else self.echo(index)
        self.started.add(index)
        return {"index": index, "text": echo + chunk.text, "token_ids": chunk.token_ids,
                "finish_reason": chunk.finish_reason, "logprobs": self._logprobs(index, chunk.logprobs)}

    def _logprobs(self, index: int, entries: list[TokenLogprob]) -> dict | None:
        """text_offset counts the characters of the tokens' own texts before each (as vLLM)."""
        if not self.logprobs:
            return None
        tokens = [self.piece(e.token) for e in entries]
        offsets = list(accumulate((len(t) for t in tokens), initial=self.offsets.get(index, len(self.echo(index)))))
        self.offsets[index] = offsets.pop()
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.piece(t): lp for t, lp in e.top} | {token: e.logprob}
                                 for e, token in zip(entries, tokens)],
                "text_offset": offsets}


class _Chat:
    """/v1/chat/completions choices: an assistant message (a delta in streams), logprobs as content[]."""

    object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, piece: Callable[[int], str], body: ChatBody, token_bytes: Callable[[int], bytes]):
        self.piece, self.logprobs, self.token_bytes = piece, body.logprobs, token_bytes
        self.started: set[int] = set()

    def choice(self, s: Sample) -> dict:
        return {"index": s.index, "message": {"role": "assistant", "content": s.text}, "token_ids": s.token_ids,
                "finish_reason": s.finish_reason, "logprobs": self._logprobs(s.logprobs)}

    def chunk_choice(self, index: int, chunk: Chunk) -> dict:
        delta = {"content": chunk.text} if index in self.started else {"role": "assistant", "content": chunk.text}
        self.started.add(index)
        return {"index": index, "delta": delta, "token_ids": chunk.token_ids, "finish_reason": chunk.finish_reason,
                "logprobs": self._logprobs(chunk.logprobs)}

    def _logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        if not self.logprobs:
            return None
        return {"content": [self._entry(e.token, e.logprob) | {"top_logprobs": [self._entry(t, lp) for t, lp in e.top]}
                            for e in entries]}

    def _entry(self, token: int, logprob: float) -> dict:
        return {"token": self.piece(token), "logprob": logprob, "bytes": list(self.token_bytes(token))}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(event: dict | str) -> str:
    return f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n"


# --- the endpoints -----------------------------------------------------------------------------------


class OpenAIServer:
    """What the ingress's HTTP routes answer, over its Frontend."""

    def __init__(self, frontend: Frontend, model_name: str):
        self.frontend, self.model_name, self.created = frontend, model_name, int(time.time())

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def check_model(self, name: str | None) -> None:
        """HttpError 404 (OpenAI's model_not_found) for a model other than the one served; none named: that one."""
        if name is not None and name != self.model_name:
            raise HttpError(404, f"model {name!r} is not served here (it serves {self.model_name!r})", "model",
                            code="model_not_found")

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "specdec",
                "max_model_len": self.frontend.context}

    async def completions(self, raw: bytes, tenant: str = ""):
        """tenant: the caller's API key's scope (Request.tenant), set by the ingress."""
        try:
            body = await parsed(raw, CompletionBody)
            self.check_model(body.model)
            prompts = body.prompts()
            places = self.frontend.admission.most_samples
            if len(prompts) > 1 and len(prompts) * body.n > places:  # one prompt: admission names n
                raise HttpError(400, f"prompt: {len(prompts)} prompts x n {body.n} samples, over the {places} one "
                                     "request may run (server.max_n, server.max_queued_requests)", "prompt")
            jobs = await self._admit_all([body.request(p, body.logprobs, tenant=tenant) for p in prompts],
                                         {"max_new_tokens": body.max_tokens_field()})
            try:  # until its samples start, the request's places are this handler's to give back
                echoes = [await asyncio.to_thread(self._echo, job) for job in jobs] if body.echo else None
            except BaseException:  # a client gone meanwhile (its handler cancelled) among them
                self._give_back(jobs)
                raise
            return await self._respond(jobs, body, _Completions(self._piece, body, echoes))
        except Exception as e:  # noqa: BLE001 - every error answers in OpenAI's shape, untyped ones as 500
            return HttpError.of(e).response()

    async def _admit_all(self, requests: list[Request], names: dict[str, str]) -> list[Admitted]:
        """Each prompt's request admitted, or none: a refusal gives back the places those before it took."""
        jobs = []
        try:
            for request in requests:
                jobs.append(await self._admit(request, names))
        except BaseException:
            self._give_back(jobs)
            raise
        return jobs

    def _give_back(self, jobs: list[Admitted]) -> None:
        """The places admitted jobs took, given back: none of their samples started (each gives back its own)."""
        for job in jobs:
            for _ in range(job.request.n):
                self.frontend.admission.release()

    def _echo(self, job: Admitted) -> str:
        """What echo puts before a completion: its prompt's text (token ids given: their decoded text)."""
        return job.request.prompt or self.frontend.tokenizer.decode(job.prompt_ids)

    async def tokenize(self, raw: bytes):
        """vLLM's /tokenize: {"count", "max_model_len", "tokens", "token_strs"}."""
        try:
            body = await parsed(raw, TokenizeBody)
            if body.text_field() == "messages":
                chat = await asyncio.to_thread(self._chat_prompt, body.messages, body.add_generation_prompt)
            else:
                chat = ChatPrompt(body.prompt, ())
            admission, field = self.frontend.admission, body.text_field()
            admission.check_prompt_text(chat.text, field)  # what the completions would take, no more
            special = body.add_special_tokens if body.add_special_tokens is not None else body.messages is None
            ids = await asyncio.to_thread(encode_prompt, self.frontend.tokenizer, chat.text, chat.literal, special)
            admission.check_prompt_tokens(len(ids), field)
            strs = await asyncio.to_thread(lambda: [self._piece(t) for t in ids]) if body.return_token_strs else None
            return {"count": len(ids), "max_model_len": self.frontend.context, "tokens": ids, "token_strs": strs}
        except Exception as e:  # noqa: BLE001 - as in completions
            return HttpError.of(e).response()

    async def detokenize(self, raw: bytes):
        """vLLM's /detokenize: {"prompt": the tokens' text}."""
        try:
            body = await parsed(raw, DetokenizeBody)
            vocab, limits = len(self.frontend.tokenizer), self.frontend.admission.limits
            most = limits.max_prompt_tokens + limits.max_new_tokens  # a request's whole sequence, at most
            if len(body.tokens) > most:
                raise HttpError(400, f"tokens: {len(body.tokens)} tokens, over the {most} of a request's prompt and "
                                     "answer (server.max_prompt_tokens + server.max_new_tokens)", "tokens")
            if any(not 0 <= t < vocab for t in body.tokens):
                raise HttpError(400, f"tokens: token ids must be in the vocabulary [0, {vocab})", "tokens")
            return {"prompt": await asyncio.to_thread(self.frontend.tokenizer.decode, body.tokens)}
        except Exception as e:  # noqa: BLE001 - as in completions
            return HttpError.of(e).response()

    async def chat(self, raw: bytes, tenant: str = ""):
        try:
            body = await parsed(raw, ChatBody)
            self.check_model(body.model)
            chat = await asyncio.to_thread(self._chat_prompt, body.messages)  # a template over a long chat: off the loop
            request = body.request(chat.text, (body.top_logprobs or 0) if body.logprobs else None,
                                   add_special_tokens=False, literal=chat.literal, tenant=tenant)
            names = {"max_new_tokens": body.max_tokens_field(), "prompt": "messages", "logprobs": "top_logprobs"}
            job = await self._admit(request, names)
            return await self._respond([job], body, _Chat(self._piece, body, self._bytes))
        except Exception as e:  # noqa: BLE001 - as in completions
            return HttpError.of(e).response()

    def _chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> ChatPrompt:
        """The messages as the target's chat template renders them; a special token spelt in their text is
        tokenized as text (specdec.chat), so a message cannot open or close a turn."""
        tokenizer = self.frontend.tokenizer
        if not tokenizer.chat_template:
            raise HttpError(400, "messages: the target's tokenizer has no chat template (chat_template in its "
                                 "tokenizer files), so chat completions are not served: use /v1/completions",
                            "messages")
        try:
            return render_chat(tokenizer, [m.model_dump(exclude_none=True) for m in messages], add_generation_prompt)
        except TemplateError as e:
            raise HttpError(400, f"messages: the chat template refused them: {e}", "messages") from None

    async def _admit(self, request: Request, names: dict[str, str]) -> Admitted:
        """The frontend's admission (tokenizing off the event loop); a bad field named as the body names
        it (names: Request -> body)."""
        try:
            return await self.frontend.admission.admit_async(request)
        except InvalidArgument as e:
            name = names.get(e.field, e.field)
            reason = e.reason.replace("max_new_tokens", names.get("max_new_tokens", "max_new_tokens"))
            raise HttpError(400, f"{name}: {reason}", name, code=e.code) from None

    def _piece(self, token: int) -> str:
        return token_text(self.frontend.tokenizer, token)

    def _bytes(self, token: int) -> bytes:
        return token_bytes(self.frontend.tokenizer, token)

    async def _respond(self, jobs: list[Admitted], body: _Body, shape: _Completions | _Chat):
        """jobs: the request's prompts' (one, but for a completions request of several prompts)."""
        head = {"id": f"{shape.id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": self.model_name}
        prompt_tokens = sum(len(job.prompt_ids) for job in jobs)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            chunks = run_samples(self.frontend, jobs)
            try:  # an error before the first token still gets its status (429, 503, 500)
                first = await anext(chunks, None)
            except BaseException:
                await chunks.aclose()
                raise
            return StreamingResponse(self._events(first, chunks, prompt_tokens, shape, head, usage,
                                                  body.continuous_usage), media_type="text/event-stream")
        samples = await gather_samples(self.frontend, jobs)
        return {**head, "object": shape.object, "choices": [shape.choice(s) for s in samples],
                "usage": _usage(prompt_tokens, sum(len(s.token_ids) for s in samples)),
                "speculation": samples[0].stats.to_dict()}

    async def _events(self, first: tuple[int, Chunk] | None, chunks: AsyncIterator[tuple[int, Chunk]],
                      prompt_tokens: int, shape: _Completions | _Chat, head: dict, usage: bool,
                      continuous: bool) -> AsyncIterator[str]:
        """The stream's events from its first chunk on; an error after the first (the target group lost
        mid-stream, the request's row failed) ends it with an error event in OpenAI's shape, as the status
        has been sent (an untyped error as 500 with a generic message). `continuous`: every event carries
        the usage so far (vLLM's continuous_usage_stats), else null (with include_usage) or none."""
        head = {**head, "object": shape.chunk_object}
        completion_tokens, item = 0, first
        try:
            while item is not None:
                index, chunk = item
                completion_tokens += len(chunk.token_ids)
                event = {**head, "choices": [shape.chunk_choice(index, chunk)]}
                if usage:
                    event["usage"] = _usage(prompt_tokens, completion_tokens) if continuous else None
                yield _sse(event | ({"speculation": chunk.stats.to_dict()} if chunk.finish_reason else {}))
                item = await anext(chunks, None)
        except Exception as e:  # noqa: BLE001 - ends the stream with its error, whatever it was
            error = HttpError.of(e)
            yield _sse({"error": {"message": error.message, "type": error.kind, "param": error.param,
                                  "code": error.code}})
            yield _sse("[DONE]")  # as vLLM: a client reading to the end finds it
            return
        finally:
            await chunks.aclose()
        if usage:
            yield _sse({**head, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)})
        yield _sse("[DONE]")

from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Speculation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATION_AUTO: _ClassVar[Speculation]
    SPECULATION_ON: _ClassVar[Speculation]
    SPECULATION_OFF: _ClassVar[Speculation]
SPECULATION_AUTO: Speculation
SPECULATION_ON: Speculation
SPECULATION_OFF: Speculation

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "task_type", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "speculation", "stop", "n", "logprobs", "min_p", "min_tokens", "ignore_eos", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "response_format", "drafter", "cache_salt")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TASK_TYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    task_type: str
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    speculation: Speculation
    stop: _containers.RepeatedScalarFieldContainer[str]
    n: int
    logprobs: int
    min_p: float
    min_tokens: int
    ignore_eos: bool
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    response_format: ResponseFormat
    drafter: str
    cache_salt: str
    def __init__(self, prompt: _Optional[str] = ..., task_type: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., speculation: _Optional[_Union[Speculation, str]] = ..., stop: _Optional[_Iterable[str]] = ..., n: _Optional[int] = ..., logprobs: _Optional[int] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., drafter: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("type", "json_schema")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    type: str
    json_schema: str
    def __init__(self, type: _Optional[str] = ..., json_schema: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ("speculative", "drafted", "accepted", "steps", "alpha", "tried")
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    TRIED_FIELD_NUMBER: _ClassVar[int]
    speculative: bool
    drafted: int
    accepted: int
    steps: int
    alpha: float
    tried: int
    def __init__(self, speculative: _Optional[bool] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., steps: _Optional[int] = ..., alpha: _Optional[float] = ..., tried: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats", "index", "logprobs", "more_samples")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MORE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stats: SpeculationStats
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    more_samples: _containers.RepeatedCompositeFieldContainer[GenerateResponse]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[SpeculationStats, _Mapping]] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., more_samples: _Optional[_Iterable[_Union[GenerateResponse, _Mapping]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TaskTypeStats(_message.Message):
    __slots__ = ("task_type", "alpha", "decision", "k", "samples", "requests", "reason", "goodput", "drafter", "drafters")
    class RequestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class GoodputEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class DraftersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: DrafterStats
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[DrafterStats, _Mapping]] = ...) -> None: ...
    TASK_TYPE_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    task_type: str
    alpha: float
    decision: str
    k: int
    samples: int
    requests: _containers.ScalarMap[str, int]
    reason: str
    goodput: _containers.ScalarMap[str, float]
    drafter: str
    drafters: _containers.MessageMap[str, DrafterStats]
    def __init__(self, task_type: _Optional[str] = ..., alpha: _Optional[float] = ..., decision: _Optional[str] = ..., k: _Optional[int] = ..., samples: _Optional[int] = ..., requests: _Optional[_Mapping[str, int]] = ..., reason: _Optional[str] = ..., goodput: _Optional[_Mapping[str, float]] = ..., drafter: _Optional[str] = ..., drafters: _Optional[_Mapping[str, DrafterStats]] = ...) -> None: ...

class DrafterStats(_message.Message):
    __slots__ = ("alpha", "samples", "goodput")
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_FIELD_NUMBER: _ClassVar[int]
    alpha: float
    samples: int
    goodput: float
    def __init__(self, alpha: _Optional[float] = ..., samples: _Optional[int] = ..., goodput: _Optional[float] = ...) -> None: ...

class TargetStats(_message.Message):
    __slots__ = ("state", "reason", "rebuilds", "last_recovery_s", "open_requests", "kv_tokens_reserved", "waiting", "largest_batch", "idle_rows_closed", "prefix_cached_tokens", "prefix_prompt_tokens", "prefix_hit_tokens", "prefix_evicted_tokens", "kv_used_tokens", "kv_window_used_tokens", "prefix_feature_bytes")
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REBUILDS_FIELD_NUMBER: _ClassVar[int]
    LAST_RECOVERY_S_FIELD_NUMBER: _ClassVar[int]
    OPEN_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_RESERVED_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    LARGEST_BATCH_FIELD_NUMBER: _ClassVar[int]
    IDLE_ROWS_CLOSED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_EVICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FEATURE_BYTES_FIELD_NUMBER: _ClassVar[int]
    state: str
    reason: str
    rebuilds: int
    last_recovery_s: float
    open_requests: int
    kv_tokens_reserved: int
    waiting: int
    largest_batch: int
    idle_rows_closed: int
    prefix_cached_tokens: int
    prefix_prompt_tokens: int
    prefix_hit_tokens: int
    prefix_evicted_tokens: int
    kv_used_tokens: int
    kv_window_used_tokens: int
    prefix_feature_bytes: int
    def __init__(self, state: _Optional[str] = ..., reason: _Optional[str] = ..., rebuilds: _Optional[int] = ..., last_recovery_s: _Optional[float] = ..., open_requests: _Optional[int] = ..., kv_tokens_reserved: _Optional[int] = ..., waiting: _Optional[int] = ..., largest_batch: _Optional[int] = ..., idle_rows_closed: _Optional[int] = ..., prefix_cached_tokens: _Optional[int] = ..., prefix_prompt_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., prefix_evicted_tokens: _Optional[int] = ..., kv_used_tokens: _Optional[int] = ..., kv_window_used_tokens: _Optional[int] = ..., prefix_feature_bytes: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("task_types", "target", "in_flight")
    TASK_TYPES_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    task_types: _containers.RepeatedCompositeFieldContainer[TaskTypeStats]
    target: TargetStats
    in_flight: int
    def __init__(self, task_types: _Optional[_Iterable[_Union[TaskTypeStats, _Mapping]]] = ..., target: _Optional[_Union[TargetStats, _Mapping]] = ..., in_flight: _Optional[int] = ...) -> None: ...

from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "logprobs", "min_p", "min_tokens", "end_ids", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "grammar", "cache_salt")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    END_IDS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    logprobs: int
    min_p: float
    min_tokens: int
    end_ids: _containers.RepeatedScalarFieldContainer[int]
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    grammar: str
    cache_salt: str
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., end_ids: _Optional[_Iterable[int]] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., grammar: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class OpenRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "params", "stream", "max_new_tokens", "feature_layers")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    stream: int
    max_new_tokens: int
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., stream: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., feature_layers: _Optional[_Iterable[int]] = ...) -> None: ...

class OpenResponse(_message.Message):
    __slots__ = ("first",)
    FIRST_FIELD_NUMBER: _ClassVar[int]
    first: VerifyResult
    def __init__(self, first: _Optional[_Union[VerifyResult, _Mapping]] = ...) -> None: ...

class Features(_message.Message):
    __slots__ = ("data", "rows", "width", "dtype")
    DATA_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    rows: int
    width: int
    dtype: str
    def __init__(self, data: _Optional[bytes] = ..., rows: _Optional[int] = ..., width: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class PromptFeaturesRequest(_message.Message):
    __slots__ = ("request_id", "start")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    start: int
    def __init__(self, request_id: _Optional[str] = ..., start: _Optional[int] = ...) -> None: ...

class PromptFeaturesResponse(_message.Message):
    __slots__ = ("features", "total_rows")
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    features: Features
    total_rows: int
    def __init__(self, features: _Optional[_Union[Features, _Mapping]] = ..., total_rows: _Optional[int] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("ids", "probs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ids: bytes
    probs: bytes
    def __init__(self, ids: _Optional[bytes] = ..., probs: _Optional[bytes] = ...) -> None: ...

class CandidateTree(_message.Message):
    __slots__ = ("request_id", "tokens", "parents", "proposal_ids", "proposals", "from_model", "guess")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_IDS_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    FROM_MODEL_FIELD_NUMBER: _ClassVar[int]
    GUESS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    proposal_ids: _containers.RepeatedScalarFieldContainer[int]
    proposals: _containers.RepeatedCompositeFieldContainer[Proposal]
    from_model: _containers.RepeatedScalarFieldContainer[bool]
    guess: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., proposal_ids: _Optional[_Iterable[int]] = ..., proposals: _Optional[_Iterable[_Union[Proposal, _Mapping]]] = ..., from_model: _Optional[_Iterable[bool]] = ..., guess: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("trees",)
    TREES_FIELD_NUMBER: _ClassVar[int]
    trees: _containers.RepeatedCompositeFieldContainer[CandidateTree]
    def __init__(self, trees: _Optional[_Iterable[_Union[CandidateTree, _Mapping]]] = ...) -> None: ...

class CommittedLogprob(_message.Message):
    __slots__ = ("logprob", "top_tokens", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_tokens: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_tokens: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class RowError(_message.Message):
    __slots__ = ("code", "field", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    field: str
    message: str
    def __init__(self, code: _Optional[int] = ..., field: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("request_id", "path", "tokens", "logprobs", "error", "features")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    path: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[CommittedLogprob]
    error: RowError
    features: Features
    def __init__(self, request_id: _Optional[str] = ..., path: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[CommittedLogprob, _Mapping]]] = ..., error: _Optional[_Union[RowError, _Mapping]] = ..., features: _Optional[_Union[Features, _Mapping]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyResult]
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyResult, _Mapping]]] = ...) -> None: ...

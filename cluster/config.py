"""The operator's YAML config: one pydantic model tree, errors that name the file and the key path,
the live part (routing) that Serve's reconfigure applies, and the command-line overrides."""

import difflib
import os
import re
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import ErrorDetails

from specdec.drafter_kinds import (DEFAULT_PROPOSAL_TOP_K, DRAFT_QUANTIZATIONS, MAX_DEPTH, MAX_PROPOSAL_TOP_K,
                                   MAX_TREE_WIDTH, DrafterKind, DraftShape)
from specdec.suffix import SuffixConfig

Dtype = Literal["float32", "bfloat16", "float16"]
Port = Annotated[int, Field(ge=1, le=65535)]
NonEmpty = Annotated[str, Field(min_length=1)]

MAX_REQUEST_BYTES = 2**31 - 1  # server.max_request_bytes: gRPC's own ceiling on a message
# Ceilings on server's counts, far past any machine's, so that a typo (1e23) is named at load, not met as an
# allocation at start (the target makes its KV pool from max_kv_tokens and max_running_requests at once)
MAX_TOKENS = 10_000_000  # a prompt's, or an answer's
MAX_KV_TOKENS = 2**32
MAX_RUNNING = 65_536
MAX_REQUESTS = 1_000_000

# A task type (a request's task_type, a key of routing.task_types): the router keeps state per name and
# metrics label by it, so names are short and plain.
TASK_TYPE_MAX_CHARS = 64
TASK_TYPE_CHARS = re.compile(r"[A-Za-z0-9_.-]*")


def task_type_problem(name: str) -> str | None:
    """Why `name` is not a valid task type, or None when it is ("" is: the default)."""
    if len(name) > TASK_TYPE_MAX_CHARS:
        return f"must be at most {TASK_TYPE_MAX_CHARS} characters, got {len(name)}"
    if not TASK_TYPE_CHARS.fullmatch(name):
        return "may hold only letters, digits and _ . - (A-Z a-z 0-9 _ . -)"
    return None


class ConfigError(ValueError):
    """An invalid or unreadable config; one line per problem, each naming the file and the key."""


class _Section(BaseModel):
    # enums kept as their values: dumps are plain YAML; no float is infinite or NaN (`.inf` parses in YAML)
    model_config = ConfigDict(extra="forbid", use_enum_values=True, allow_inf_nan=False)


class ModelSpec(_Section):
    path: NonEmpty
    dtype: Dtype = "float32"


class ModelsConfig(_Section):
    target: ModelSpec
    draft: ModelSpec | None = None  # a draft model (a head here drafts as the model kinds, priced as one)
    head: ModelSpec | None = None  # a draft head for the target (EAGLE-3 or Medusa): the head kinds draft with it
    task_drafts: dict[str, ModelSpec] = Field(default_factory=dict)  # a draft of its own per task type
    # how every draft model and the head run their linear layers on a CPU (specdec.cpu_linear): int8 weights,
    # their float weights (none), or int8 where this CPU's torch runs them (auto); the target never
    draft_quantization: Literal[DRAFT_QUANTIZATIONS] = "auto"

    @field_validator("task_drafts")
    @classmethod
    def _task_type_names(cls, task_drafts: dict[str, "ModelSpec"]) -> dict[str, "ModelSpec"]:
        for name in task_drafts:
            if name in ("", "default"):
                raise ValueError(f"task type {name!r}: the draft of requests of no task type is models.draft")
            if problem := task_type_problem(name):
                raise ValueError(f"task type {name[:80]!r}: {problem}")
        return task_drafts

    def drafts(self) -> dict[str, tuple[str, str]]:
        """task type -> (path, dtype) of its draft; the "" entry is for every other task type."""
        base = {"": (self.draft.path, self.draft.dtype)} if self.draft else {}
        return base | {task: (spec.path, spec.dtype) for task, spec in self.task_drafts.items()}


class PlacementConfig(_Section):
    tensor_parallel_size: int = Field(1, ge=1)
    draft_replicas: int = Field(1, ge=0)
    gpus_per_actor: float = Field(1.0, gt=0)
    cpus_per_target_rank: int = Field(1, ge=1)  # CPU threads of each target rank (its torch intra-op threads)
    cpus_per_draft_replica: int = Field(1, ge=1)
    # Ray's GPUs are logical slots and the models run on the CPU (the CPU profile, `specdec serve` on a
    # machine without CUDA, the tests). False (a GPU cluster): an actor given a GPU by Ray that sees no
    # CUDA refuses to start (actors/target_rank.py, device_for_actor), instead of serving from its CPU.
    logical_gpus: bool = False

    @model_validator(mode="after")
    def _one_gpu_per_rank(self) -> "PlacementConfig":
        if self.tensor_parallel_size > 1 and self.gpus_per_actor < 1 and not self.logical_gpus:
            raise ValueError(
                f"gpus_per_actor {self.gpus_per_actor} < 1 with tensor_parallel_size {self.tensor_parallel_size}: "
                f"Ray may then place two target ranks on one GPU, and NCCL refuses a group with two ranks on "
                f"one device; give each rank a whole GPU (gpus_per_actor >= 1), or run the target on one rank "
                f"(tensor_parallel_size 1), or, with no real GPUs (the models on the CPU), set logical_gpus: true")
        return self


_SUFFIX = SuffixConfig()


class SuffixSection(_Section):
    """speculation.suffix: how the suffix drafters (suffix, model+suffix, head+suffix) guess (specdec.suffix)."""

    max_depth: int = Field(_SUFFIX.max_depth, ge=1, le=MAX_DEPTH)  # the longest match used, and the deepest guess
    max_spec_factor: float = Field(_SUFFIX.max_spec_factor, gt=0, le=16)  # nodes <= factor x match + offset
    max_spec_offset: float = Field(_SUFFIX.max_spec_offset, ge=0, le=MAX_DEPTH)
    min_token_prob: float = Field(_SUFFIX.min_token_prob, ge=0, le=1)  # a guess estimated less likely is left out
    max_occurrences: int = Field(_SUFFIX.max_occurrences, ge=1, le=1024)  # a match's occurrences counted
    # each draft loop's store of recent outputs holds at most this many tokens (about 100 bytes each)
    global_max_tokens: int = Field(_SUFFIX.global_max_tokens, ge=2, le=50_000_000)
    # REST: per task type, a text file or a folder of them that its requests' suffix drafts also draw from,
    # read and indexed by each draft replica at start (up to corpus_max_tokens tokens each, ~100 bytes a token)
    corpora: dict[str, NonEmpty] = Field(default_factory=dict)
    corpus_max_tokens: int = Field(1_000_000, ge=2, le=50_000_000)

    @field_validator("corpora")
    @classmethod
    def _task_type_names(cls, corpora: dict[str, str]) -> dict[str, str]:
        for name in corpora:
            if problem := task_type_problem(name):
                raise ValueError(f"task type {name[:80]!r}: {problem}")
        return corpora

    def config(self) -> SuffixConfig:
        return SuffixConfig(**self.model_dump(exclude={"corpora", "corpus_max_tokens"}))


class SpeculationConfig(_Section):
    """How drafts are made. How many tokens a step drafts is the router's choice per task type (by live
    alpha and the target's load), up to routing.*.max_k; so is the drafter, where several are listed."""

    # one drafter kind, or a list of them: every draft replica runs each, and the router chooses per task
    # type among them by measured goodput (routing.*.drafter pins one, routing.*.forbid_drafters rules some out)
    # (default: suffix decoding and the draft model with prompt lookup, the router starting from suffix; on the
    # default pair the draft model alone lost served at 1-8 clients: docs/performance.md)
    drafter: list[DrafterKind] = Field([DrafterKind.SUFFIX, DrafterKind.MODEL_NGRAM], validate_default=True)
    tree_width: int = Field(1, ge=1, le=MAX_TREE_WIDTH)
    # a sampled draft draws from (and ships) its q cut to this many likeliest tokens: bounds a tree's bytes
    proposal_top_k: int = Field(DEFAULT_PROPOSAL_TOP_K, ge=1, le=MAX_PROPOSAL_TOP_K)
    overlap: bool = False  # draft the next step while the target verifies this one (draft models and EAGLE-3 heads)
    suffix: SuffixSection = SuffixSection()

    @field_validator("drafter", mode="before")
    @classmethod
    def _one_or_several(cls, drafter: Any) -> list:
        names = drafter if isinstance(drafter, list) else [drafter]
        known = [k.value for k in DrafterKind]
        for name in names:
            if name not in known:
                raise ValueError(f"must be {', '.join(map(repr, known[:-1]))} or {known[-1]!r}, or a list of them "
                                 f"(got {name!r})")
        if not names:
            raise ValueError("an empty list: name one drafter kind, or several")
        if "none" in names and len(names) > 1:
            raise ValueError("none cannot be listed with other drafters: plain decoding is always there, "
                             "as the router's off")
        if len(set(names)) < len(names):
            raise ValueError(f"a drafter is listed twice: {', '.join(names)}")
        return names

    def kinds(self) -> tuple[DrafterKind, ...]:
        """The drafter kinds the draft replicas run, the first the router starts from."""
        return tuple(DrafterKind(k) for k in self.drafter)

    def shapes(self) -> dict[DrafterKind, DraftShape]:
        """What the draft replicas draft, per kind, and the router prices."""
        return {kind: DraftShape(kind, self.tree_width, self.proposal_top_k, self.suffix.config())
                for kind in self.kinds() if kind is not DrafterKind.NONE}

    @model_validator(mode="before")
    @classmethod
    def _removed_keys(cls, data: Any) -> Any:
        """num_speculative_tokens and max_depth were accepted once but never read when serving."""
        for key in sorted(REMOVED_SPECULATION_KEYS & set(data if isinstance(data, Mapping) else ())):
            raise ValueError(f"{key} was removed (serving never read it): the router picks how many tokens a "
                             f"step drafts per task type, up to routing.*.max_k; delete the key")
        return data


REMOVED_SPECULATION_KEYS = {"num_speculative_tokens", "max_depth"}


class Thresholds(_Section):
    """When a task type speculates, and how far."""

    on_alpha: float = Field(0.55, gt=0, le=1)  # turn speculation on at or above this alpha
    off_alpha: float = Field(0.35, ge=0, lt=1, validate_default=True)  # turn it off below this alpha
    min_samples: int = Field(20, ge=1)  # reports needed before the decision may switch
    probe_fraction: float = Field(0.05, ge=0, le=1)  # share of requests still speculative while off
    ema: float = Field(0.1, gt=0, le=1)  # weight of a new report in the alpha moving average
    max_k: int = Field(8, ge=1, le=MAX_DEPTH)
    draft_cost_ratio: float = Field(0.15, gt=0, lt=1)  # a drafted token's cost / a target step's, until measured
    speculation: Literal["auto", "on", "off"] = "auto"  # on/off: forced for AUTO requests of this task type
    # where speculation.drafter lists several: `auto` chooses among them by measured goodput; a kind pins it
    drafter: Literal["auto"] | DrafterKind = "auto"
    forbid_drafters: list[DrafterKind] = Field(default_factory=list)  # never chosen for this task type
    # another drafter, or plain decoding against speculation (and back), is chosen once its goodput beats
    # the one chosen by this share
    switch_margin: float = Field(0.05, ge=0, le=1)

    @field_validator("off_alpha")
    @classmethod
    def _below_on_alpha(cls, off_alpha: float, info: ValidationInfo) -> float:
        on_alpha = info.data.get("on_alpha")  # absent when on_alpha itself was invalid
        if on_alpha is not None and off_alpha >= on_alpha:
            raise ValueError(f"must be < on_alpha ({off_alpha} >= {on_alpha})")
        return off_alpha


class RoutingConfig(_Section):
    default: Thresholds = Field(default_factory=Thresholds)
    task_types: dict[str, Thresholds] = Field(default_factory=dict)
    # most task types the router tracks, default and the configured ones counted: a request's unknown task
    # type beyond it is routed and counted as default (task_types_folded), so memory, /v1/stats and metric
    # labels stay bounded whatever names clients send
    max_task_types: int = Field(64, ge=1, le=4096)

    @field_validator("task_types")
    @classmethod
    def _task_type_names(cls, task_types: dict[str, "Thresholds"]) -> dict[str, "Thresholds"]:
        for name in task_types:
            problem = "is the name of the default thresholds" if name in ("", "default") else task_type_problem(name)
            if problem:
                raise ValueError(f"task type {name[:80]!r}: {problem}")
        return task_types

    @model_validator(mode="after")
    def _room_for_configured(self) -> "RoutingConfig":
        if len(self.task_types) + 1 > self.max_task_types:
            raise ValueError(f"max_task_types {self.max_task_types} leaves no room for the {len(self.task_types)} "
                             f"task types configured and default (need at least {len(self.task_types) + 1})")
        return self

    def thresholds(self, task_type: str) -> Thresholds:
        return self.task_types.get(task_type, self.default)

    def check_drafters(self, served: tuple[DrafterKind, ...]) -> None:
        """ValueError naming the key where a task type pins or forbids a drafter the replicas do not run, or
        forbids every one they run."""
        for name, thresholds in [("default", self.default), *((f"task_types.{t}", v) for t, v in self.task_types.items())]:
            runs = [k for k in served if k is not DrafterKind.NONE]
            named = [thresholds.drafter] if thresholds.drafter != "auto" else []
            for kind in [*named, *thresholds.forbid_drafters]:
                if kind not in runs:
                    key = "drafter" if kind in named else "forbid_drafters"
                    raise ValueError(f"routing.{name}.{key}: {str(kind)!r} is not among the drafters served "
                                     f"(speculation.drafter: {', '.join(map(str, served))})")
            if runs and not set(runs) - set(thresholds.forbid_drafters):
                raise ValueError(f"routing.{name}.forbid_drafters forbids every drafter served "
                                 f"({', '.join(map(str, runs))}): use speculation: off for that task type")
            if thresholds.drafter in thresholds.forbid_drafters:
                raise ValueError(f"routing.{name}: drafter {str(thresholds.drafter)!r} is pinned and forbidden")


class ServerConfig(_Section):
    grpc_port: Port = 9000
    http_port: Port = Field(8000, validate_default=True)
    max_prompt_tokens: int = Field(4096, ge=1, le=MAX_TOKENS)
    max_new_tokens: int = Field(1024, ge=1, le=MAX_TOKENS)
    max_queued_requests: int = Field(256, ge=1, le=MAX_REQUESTS)  # per ingress replica: admitted and unfinished requests
    # the target's KV budget: requests it holds at once, and KV tokens (each request counted at its most:
    # prompt + max_new_tokens + room for a tree); beyond either, requests wait for room in arrival order,
    # and beyond max_waiting_requests waiting the target refuses them (RESOURCE_EXHAUSTED)
    max_running_requests: int = Field(64, ge=1, le=MAX_RUNNING)
    max_kv_tokens: int = Field(65536, ge=1, le=MAX_KV_TOKENS)
    max_waiting_requests: int = Field(256, ge=0, le=MAX_REQUESTS)
    # prefix cache: the KV of prompts and outputs kept after their requests end, on the target and on each
    # draft replica (per draft model), for later prompts that begin the same way (a shared system prompt, a
    # conversation's next turn); up to this many tokens each, in blocks of 16, least recently used evicted
    # first. Held beside the running requests' KV (max_kv_tokens), as memory is used. 0: off.
    prefix_cache_tokens: int = Field(16384, ge=0, le=10_000_000)
    # chunked prefill: the tokens one forward of the target runs at most: every tree and plain row, and in
    # the same forward joining prompts' chunks up to the rest (at least a quarter of it), so a long prompt
    # slows a few running steps instead of stalling them. 0: each joining prompt is prefilled whole, in a
    # forward of its own before the step.
    max_batched_tokens: int = Field(2048, ge=0, le=1_000_000)
    # before a forward, the target waits for speculating rows' next trees while plain rows (or other replicas'
    # trees) are ready, as long as that costs the ready rows less than the forward the late rows would miss
    # (specdec.scheduler.TreeGather). false: a forward runs as soon as any row is ready.
    gather_trees: bool = True
    idle_row_timeout_s: float = Field(30.0, gt=0)  # a speculative row with no tree for this long is closed
    max_n: int = Field(8, ge=1, le=MAX_REQUESTS)  # most samples one request may ask for (OpenAI's n)
    # the largest request body (HTTP) or message (gRPC, RAY_SERVE_GRPC_MAX_MESSAGE_SIZE of Serve's proxy), in
    # bytes; a prompt of more characters is refused before it is tokenized. Also caps gRPC replies.
    max_request_bytes: int = Field(4 * 1024 * 1024, ge=1024, le=MAX_REQUEST_BYTES)
    # POST /v1/admin/forget_outputs: the draft replicas drop the outputs their suffix drafts read (what
    # `specdec bench-served --forget-outputs` calls between cells, so each starts as a fresh server's would);
    # refused (403) unless true. API keys guard it as every route.
    allow_forget_outputs: bool = False
    # POST /v1/admin/forget_prefixes: the target and the draft replicas empty their prefix caches (what `specdec
    # bench-served --forget-prefixes` calls between cells, so a cell never reuses the prompts an earlier one sent);
    # refused (403) unless true. API keys guard it as every route.
    allow_forget_prefixes: bool = False

    @field_validator("http_port")
    @classmethod
    def _differs_from_grpc_port(cls, http_port: int, info: ValidationInfo) -> int:
        if http_port == info.data.get("grpc_port"):
            raise ValueError(f"must differ from grpc_port (both are {http_port})")
        return http_port


class InternalTls(_Section):
    """Mutual TLS on the draft -> target link (PEM files, at these paths on every node)."""

    cert: NonEmpty  # the server certificate: the target serves with it (and replicas present it without client_cert)
    key: NonEmpty  # its private key
    ca: NonEmpty  # the CA that signs every peer's certificate
    server_name: NonEmpty = "specdec-target"  # a name in the target's certificate (replicas check it, not the IP)
    client_cert: NonEmpty | None = None  # what a draft replica presents as a TLS client (None: cert)
    client_key: NonEmpty | None = None  # its private key (None: key); given with client_cert or not at all

    @model_validator(mode="after")
    def _client_pair(self) -> "InternalTls":
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("client_cert and client_key go together (set both, or neither to use cert and key)")
        return self


class SecurityConfig(_Section):
    # The public API's keys (gRPC and HTTP), one per line; without it (and without SPECDEC_API_KEYS,
    # which wins when set) no key is asked for. cluster/auth.py reads it when the ingress starts.
    api_keys_file: NonEmpty | None = None
    internal_tls: InternalTls | None = None  # without it the link is plaintext, still with the secret
    # Each API key's requests share cached work (prefix caches, suffix drafts' outputs) only with requests made
    # with the same key: a client's own cache_salt then scopes within its key's. Needs API keys.
    cache_per_api_key: bool = False

    def check_internal_tls_files(self) -> None:
        """At start, before any actor is placed: every internal TLS file is readable here."""
        if self.internal_tls is not None:
            for name in ("cert", "key", "ca", "client_cert", "client_key"):
                if getattr(self.internal_tls, name) is not None:
                    check_readable(getattr(self.internal_tls, name), f"security.internal_tls.{name}")


def check_readable(path: str, key: str) -> None:
    """ConfigError naming the key when the file it names cannot be read."""
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path} ({e.strerror or e})") from None


class ServeConfig(_Section):
    models: ModelsConfig
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    speculation: SpeculationConfig = Field(default_factory=SpeculationConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)

    @model_validator(mode="after")
    def _draft_for_model_drafters(self) -> "ServeConfig":
        for drafter in self.speculation.kinds():
            if drafter.uses_model and not self.models.drafts():
                raise ValueError(f"speculation.drafter {str(drafter)!r} needs models.draft (or models.task_drafts); "
                                 f"without a draft model use drafter ngram, suffix or none")
            if drafter.uses_head and self.models.head is None:
                raise ValueError(f"speculation.drafter {str(drafter)!r} needs models.head (a draft head's folder: "
                                 f"`specdec distill --head eagle3` trains one); without one use another drafter")
        if self.models.head is not None and not any(kind.uses_head for kind in self.speculation.kinds()):
            raise ValueError(f"models.head is given but no drafter runs it: list head or head+suffix in "
                             f"speculation.drafter (now {', '.join(self.speculation.drafter)})")
        return self

    @model_validator(mode="after")
    def _routing_names_served_drafters(self) -> "ServeConfig":
        self.routing.check_drafters(self.speculation.kinds())
        return self


# the models the drafters need besides the target ({"draft", "head"}) -> {"target": dir[, "draft": dir][, "head": dir]}
DefaultModels = Callable[[frozenset[str]], dict[str, str]]


def default_models(needs: frozenset[str] = frozenset({"draft"})) -> dict[str, str]:
    """The embedded default pair (built on first use): {"target": dir} with "draft": dir and "head": dir where the
    drafters served run them (`needs`; each built only then)."""
    from specdec.default_models import default_pair

    return default_pair(needs=needs)


def load_config(path: str | os.PathLike, default_models: DefaultModels | None = None,
                drafter: str | None = None) -> ServeConfig:
    """The config file at `path`. A file without a models section serves `default_models(needs)` (the
    embedded default pair, with its draft model and its head only where the drafters, `drafter` or else the
    file's, run them) when that is given, as the example configs/default.yaml does; without it one is an error."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read config file ({getattr(e, 'strerror', None) or e})") from None
    data = _parse_yaml(text, str(path))
    if default_models is not None and isinstance(data, Mapping) and "models" not in data:
        data = {**data, "models": _models(default_models(_needs(drafter, data)))}
    return parse_config(data, source=str(path))


def _needs(drafter: str | list | None, data: Mapping) -> frozenset[str]:
    """The models besides the target that the drafters (given, else the config's, else the default) run: "draft"
    (the draft model), "head" (the draft head). An unknown name needs the draft model, and is refused by the
    validation that follows."""
    name = drafter or ((data.get("speculation") if isinstance(data.get("speculation"), Mapping) else None)
                       or {}).get("drafter") or SpeculationConfig().drafter
    kinds = [DrafterKind(n) if isinstance(n, str) and n in set(DrafterKind) else None
             for n in (name if isinstance(name, list) else [name])]
    return frozenset({*(["draft"] if any(k is None or k.uses_model for k in kinds) else []),
                      *(["head"] if any(k is not None and k.uses_head for k in kinds) else [])})


def _given_models(args: Mapping) -> dict[str, str]:
    """--target, --draft and --head, when --target is given."""
    return {name: args[name] for name in ("target", "draft", "head") if args.get(name)} if args.get("target") else {}


def _models(paths: dict[str, str]) -> dict:
    """{"target": dir, "draft": dir, "head": dir} (each but the target where given) as a models section."""
    return {name: {"path": path} for name, path in paths.items()}


def parse_config(text_or_dict: str | Mapping, source: str = "<string>") -> ServeConfig:
    data = _parse_yaml(text_or_dict, source) if isinstance(text_or_dict, str) else text_or_dict
    if not isinstance(data, Mapping):
        got = "an empty document" if data is None else f"a {type(data).__name__}"
        sections = ", ".join(ServeConfig.model_fields)
        raise ConfigError(f"{source}: the document must be a mapping of sections ({sections}), got {got}")
    try:
        return ServeConfig.model_validate(dict(data))
    except ValidationError as e:
        problems = [f"{source}: {_key_path(err['loc'])}: {_reason(err)}" for err in e.errors()]
        raise ConfigError("\n".join(problems)) from None


class _UniqueKeys(yaml.SafeLoader):
    """yaml.safe_load's loader, but a key given twice in one mapping is an error: YAML's loaders keep the last one
    and drop the first silently (a second `server:` section dropped the whole first)."""


def _unique_mapping(loader: _UniqueKeys, node: yaml.MappingNode, deep: bool = False) -> dict:
    first: dict = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *anchor` merges keys that the mapping may override
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, Hashable) and key in first:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r} (first at line "
                                                                f"{first[key] + 1})", key_node.start_mark)
        first[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep)


_UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def _parse_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_UniqueKeys)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        raise ConfigError(f"{where}: YAML syntax error: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: YAML syntax error: {' '.join(str(e).split())}") from None


def _key_path(loc: tuple) -> str:
    return ".".join(map(str, loc)) or "<top level>"


def _reason(err: ErrorDetails) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return "extra key not allowed" + _key_hint(str(err["loc"][-1]), _keys_at(err["loc"][:-1]))
    if kind == "missing":
        return "required key missing"
    if kind == "value_error":
        return str(err["ctx"]["error"])
    if kind in ("model_type", "dict_type"):
        return f"must be a mapping (got {err['input']!r})"
    return f"{err['msg'].replace('Input should be', 'must be')} (got {err['input']!r})"


def _key_hint(key: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    return f" (did you mean {close[0]!r}?)" if close else f" (allowed: {', '.join(allowed)})"


def _keys_at(loc: tuple) -> list[str]:
    """The keys the section at `loc` accepts (a task type name in a dict of sections is any key)."""
    node: Any = ServeConfig
    for part in loc:
        node = get_args(node)[1] if get_origin(node) is dict else _unwrap_optional(node.model_fields[part].annotation)
    return list(node.model_fields)


def _unwrap_optional(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, UnionType):
        return next(arg for arg in get_args(annotation) if arg is not type(None))
    return annotation


class LiveConfig(_Section):
    """What may change while serving: Ray Serve hands it to the ingress's reconfigure() as the
    deployment's user_config (KubeRay applies an edited serveConfigV2 in place). Only `routing`; any
    other key is refused, naming it, and nothing of the update is applied."""

    routing: RoutingConfig


def parse_live_config(data: Any, source: str = "user_config") -> RoutingConfig:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: must be a mapping with one key, routing (got {data!r})")
    try:
        return LiveConfig.model_validate(dict(data)).routing
    except ValidationError as e:
        problems = [f"{source}: {_key_path(err['loc'])}: {_live_reason(err)}" for err in e.errors()]
        raise ConfigError("\n".join(problems)) from None


def _live_reason(err: ErrorDetails) -> str:
    if err["type"] == "extra_forbidden" and len(err["loc"]) == 1:
        return "cannot change while serving: only routing reloads live (the other sections need a redeploy)"
    if err["type"] == "extra_forbidden":
        return "extra key not allowed" + _key_hint(str(err["loc"][-1]), _keys_at(("routing",) + err["loc"][1:-1]))
    return _reason(err)


# `specdec serve` flags and build_app args that override a key of the config: arg -> (section, key)
OVERRIDES = {
    "target": ("models", "target"), "draft": ("models", "draft"), "head": ("models", "head"),
    "tensor_parallel_size": ("placement", "tensor_parallel_size"), "draft_replicas": ("placement", "draft_replicas"),
    "grpc_port": ("server", "grpc_port"), "http_port": ("server", "http_port"),
    "logical_gpus": ("placement", "logical_gpus"), "drafter": ("speculation", "drafter"),
}


def app_config(args: Mapping, default_models: DefaultModels) -> ServeConfig:
    """The config that `specdec serve` and build_app run: the YAML at args["config"], or, without one,
    the models given by args["target"]/["draft"]/["head"], or else `default_models()` (the embedded pair,
    built only in that case, or for a file without a models section and no --target); then every
    override in args that is not None, re-validated as a whole."""
    if args.get("config"):  # a file without models: the command line's, else the default pair
        data = load_config(args["config"], lambda needs: _given_models(args) or default_models(needs),
                           args.get("drafter")).model_dump()
    elif args.get("target"):  # as `specdec generate`: model+ngram with a draft, the head with a head, else ngram
        drafters = [*(["model+ngram"] if args.get("draft") else []), *(["head"] if args.get("head") else [])]
        data = {"models": {"target": {"path": args["target"]}}, "speculation": {"drafter": drafters or "ngram"}}
    elif args.get("draft") or args.get("head"):
        raise ConfigError(f"--{'draft' if args.get('draft') else 'head'} without --target or --config: give the "
                          f"target too")
    else:
        data = {"models": _models(default_models(_needs(args.get("drafter"), {})))}
    for arg, (section, key) in OVERRIDES.items():
        if args.get(arg) is None:
            continue
        value = args[arg]
        if key in ("target", "draft", "head"):
            value = {"path": value, "dtype": ((data.get(section) or {}).get(key) or {}).get("dtype", "float32")}
        data.setdefault(section, {})[key] = value
    source = "the config with command-line overrides" if args.get("config") else "the command-line models"
    return parse_config(data, source=source)

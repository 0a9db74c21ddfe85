"""Operator config: validation with errors naming the file, key path and reason; the live part
(routing, Serve's user_config); the command-line models and overrides."""

import re
from pathlib import Path

import pytest
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

from cluster.config import ConfigError, app_config, load_config, parse_config, parse_live_config
from specdec.drafter_kinds import DrafterKind

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_YAML = ROOT / "configs" / "default.yaml"  # the example a clone serves: the embedded default pair
SHARED_PAIR = ROOT / "tools" / "bench" / "shared-pair.yaml"  # the bench pair in ../shared
MINIMAL = {"models": {"target": {"path": "t"}, "draft": {"path": "d"}}}


def with_section(section: str, values: dict) -> dict:
    return {**MINIMAL, section: values}


def config_error(data) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="ops.yaml")
    return str(info.value)


def test_default_yaml_serves_the_default_pair():
    """configs/default.yaml has no models section: it serves the embedded default pair, and a file
    without one is refused where no default is offered."""
    config = load_config(DEFAULT_YAML, lambda needs: {"target": "dt", "draft": "dd"})
    assert (config.models.target.path, config.models.draft.path) == ("dt", "dd")
    with pytest.raises(ConfigError, match="models"):
        load_config(DEFAULT_YAML)
    cfg = app_config({"config": str(DEFAULT_YAML), "target": "t", "draft": "d"}, never_called)
    assert (cfg.models.target.path, cfg.models.draft.path) == ("t", "d")  # --target and --draft fill it


def test_the_shared_pair_config_is_the_default_one_with_the_bench_models():
    shared = load_config(SHARED_PAIR)
    assert shared == load_config(DEFAULT_YAML, lambda needs: {"target": "../shared/bench-models/target",
                                                        "draft": "../shared/bench-models/draft"})


def test_shared_pair_yaml_loads():
    config = load_config(SHARED_PAIR)
    assert config.models.target.path == "../shared/bench-models/target"
    assert config.models.draft.path == "../shared/bench-models/draft"
    assert set(config.routing.task_types) == {"code", "prose"}
    assert config.routing.thresholds("prose").on_alpha == 0.6
    assert config.routing.thresholds("poetry") == config.routing.default


def test_round_trip():
    config = load_config(SHARED_PAIR)
    assert parse_config(yaml.safe_dump(config.model_dump())) == config
    assert parse_config(config.model_dump()) == config


def test_defaults():
    config = parse_config("models: {target: {path: t}, draft: {path: d}}")
    assert config.models.target.dtype == "float32" and config.models.task_drafts == {}
    p = config.placement
    assert (p.tensor_parallel_size, p.draft_replicas, p.gpus_per_actor) == (1, 1, 1.0)
    assert (p.cpus_per_target_rank, p.cpus_per_draft_replica) == (1, 1)
    assert p.logical_gpus is False  # a GPU from Ray means a CUDA device (actors refuse to start without one)
    assert config.speculation.drafter == ["suffix", "model+ngram"] and config.speculation.tree_width == 1
    t = config.routing.default
    assert (t.on_alpha, t.off_alpha, t.min_samples, t.probe_fraction, t.ema, t.max_k, t.draft_cost_ratio) == (
        0.55, 0.35, 20, 0.05, 0.1, 8, 0.15)
    assert config.routing.task_types == {}
    s = config.server
    assert (s.grpc_port, s.http_port) == (9000, 8000)
    assert (s.max_prompt_tokens, s.max_new_tokens, s.max_queued_requests) == (4096, 1024, 256)
    assert config.security.api_keys_file is None and config.security.internal_tls is None  # both off
    assert (s.max_running_requests, s.max_kv_tokens, s.max_waiting_requests, s.idle_row_timeout_s) == (
        64, 65536, 256, 30.0)


@pytest.mark.parametrize(
    "data, expected",
    [
        ({**MINIMAL, "sevrer": {}}, "ops.yaml: sevrer: extra key not allowed (did you mean 'server'?)"),
        (
            with_section("routing", {"task_types": {"code": {"on_alpa": 0.5}}}),
            "ops.yaml: routing.task_types.code.on_alpa: extra key not allowed (did you mean 'on_alpha'?)",
        ),
        (
            {"models": {"target": {"path": "t"}, "draft": {"path": "d", "dtyp": "float16"}}},
            "ops.yaml: models.draft.dtyp: extra key not allowed (did you mean 'dtype'?)",
        ),
        (
            with_section("placement", {"zzz": 1}),
            "ops.yaml: placement.zzz: extra key not allowed"
            " (allowed: tensor_parallel_size, draft_replicas, gpus_per_actor, cpus_per_target_rank,"
            " cpus_per_draft_replica, logical_gpus)",
        ),
        (
            with_section("routing", {"task_types": {"code": {"on_alpha": 0.5, "off_alpha": 0.6}}}),
            "ops.yaml: routing.task_types.code.off_alpha: must be < on_alpha (0.6 >= 0.5)",
        ),
        (
            with_section("routing", {"default": {"on_alpha": 0.3}}),  # the default off_alpha (0.35) is now too high
            "ops.yaml: routing.default.off_alpha: must be < on_alpha (0.35 >= 0.3)",
        ),
        (
            {"models": {"target": {"path": "t", "dtype": "fp8"}}},
            "ops.yaml: models.target.dtype: must be 'float32', 'bfloat16' or 'float16' (got 'fp8')",
        ),
        (
            with_section("placement", {"tensor_parallel_size": -2}),
            "ops.yaml: placement.tensor_parallel_size: must be greater than or equal to 1 (got -2)",
        ),
        (
            with_section("server", {"grpc_port": 8000, "http_port": 8000}),
            "ops.yaml: server.http_port: must differ from grpc_port (both are 8000)",
        ),
        (
            with_section("server", {"grpc_port": 8000}),  # the default http_port
            "ops.yaml: server.http_port: must differ from grpc_port (both are 8000)",
        ),
        (
            with_section("server", {"idle_row_timeout_s": 0}),
            "ops.yaml: server.idle_row_timeout_s: must be greater than 0 (got 0)",
        ),
        (
            with_section("server", {"max_waiting_requests": -1}),
            "ops.yaml: server.max_waiting_requests: must be greater than or equal to 0 (got -1)",
        ),
        (
            with_section("speculation", {"num_speculative_tokens": 4}),
            "ops.yaml: speculation: num_speculative_tokens was removed (serving never read it): the router picks "
            "how many tokens a step drafts per task type, up to routing.*.max_k; delete the key",
        ),
        (
            with_section("speculation", {"max_depth": 8, "tree_width": 2}),
            "ops.yaml: speculation: max_depth was removed (serving never read it): the router picks "
            "how many tokens a step drafts per task type, up to routing.*.max_k; delete the key",
        ),
        ({"placement": {}}, "ops.yaml: models: required key missing"),
        (with_section("security", {"internal_tls": {"cert": "c.pem", "ca": "ca.pem"}}),
         "ops.yaml: security.internal_tls.key: required key missing"),
        (with_section("security", {"internal_tls": {"cert": "c", "key": "k", "ca": "ca", "server_name": ""}}),
         "ops.yaml: security.internal_tls.server_name: String should have at least 1 character (got '')"),
        (with_section("security", {"api_key_file": "keys"}),
         "ops.yaml: security.api_key_file: extra key not allowed (did you mean 'api_keys_file'?)"),
        (with_section("routing", {"default": [0.5]}), "ops.yaml: routing.default: must be a mapping (got [0.5])"),
    ],
)
def test_bad_values_name_the_key_path_and_reason(data, expected):
    assert config_error(data) == expected


def test_every_problem_gets_a_line():
    message = config_error({**MINIMAL, "extra": 1, "server": {"grpc_port": 0}, "routing": {"default": {"ema": 0}}})
    assert message.splitlines() == [
        "ops.yaml: routing.default.ema: must be greater than 0 (got 0)",
        "ops.yaml: server.grpc_port: must be greater than or equal to 1 (got 0)",
        "ops.yaml: extra: extra key not allowed (allowed: models, placement, speculation, routing, server, security)",
    ]


def test_yaml_syntax_error_names_file_and_line():
    assert config_error("models:\n  target: {path: t\nserver: {}\n").startswith("ops.yaml:3:")
    assert "YAML syntax error" in config_error("models: [unclosed\n")


@pytest.mark.parametrize(
    "text, got", [("- a\n- b\n", "got a list"), ("just text", "got a str"), ("", "got an empty document")]
)
def test_document_must_be_a_mapping(text, got):
    message = config_error(text)
    assert message.startswith("ops.yaml: the document must be a mapping of sections (models, placement,")
    assert message.endswith(got)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=f"^{path}: cannot read config file \\(No such file or directory\\)$"):
        load_config(path)


def test_load_config_names_the_file(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("models: {target: {path: t, dtype: int8}}\n")
    with pytest.raises(ConfigError, match=f"^{path}: models.target.dtype: "):
        load_config(path)


def test_draft_quantization_is_one_of_its_values_and_int8_where_auto_can(tmp_path):
    """models.draft_quantization: how drafts' linear layers run on a CPU (specdec.cpu_linear); auto by default."""
    models = {"target": {"path": "t"}, "draft": {"path": "d"}}
    assert parse_config({"models": models}).models.draft_quantization == "auto"
    assert parse_config({"models": models | {"draft_quantization": "none"}}).models.draft_quantization == "none"
    path = tmp_path / "serve.yaml"
    path.write_text("models: {target: {path: t}, draft: {path: d}, draft_quantization: fp8}\n")
    with pytest.raises(ConfigError, match=f"^{path}: models.draft_quantization: .*'auto', 'int8' or 'none'"):
        load_config(path)
    # a CPU machine serves a config without placement.logical_gpus as logical (cluster/local.py): int8 is checked
    # where the drafts load (specdec.cpu_linear.serve_draft_linears), not here
    assert parse_config({"models": models | {"draft_quantization": "int8"}}).models.draft_quantization == "int8"


def test_internal_tls_files_are_checked_at_start_naming_the_key(tmp_path):
    pem = tmp_path / "cert.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\n")
    tls = {"cert": str(pem), "key": str(tmp_path / "absent.pem"), "ca": str(pem)}
    config = parse_config(with_section("security", {"internal_tls": tls}))
    assert config.security.internal_tls.server_name == "specdec-target"
    with pytest.raises(ConfigError, match=f"^security.internal_tls.key: cannot read {tmp_path}/absent.pem "
                                          f"\\(No such file or directory\\)$"):
        config.security.check_internal_tls_files()
    readable = parse_config(with_section("security", {"internal_tls": {**tls, "key": str(pem)}}))
    readable.security.check_internal_tls_files()  # raises nothing


def test_a_model_drafter_needs_a_draft_model():
    message = config_error({"models": {"target": {"path": "t"}}})
    assert "speculation.drafter 'model+ngram' needs models.draft" in message
    assert parse_config({"models": {"target": {"path": "t"}}, "speculation": {"drafter": "ngram"}}).models.draft is None
    assert parse_config({"models": {"target": {"path": "t"}}, "speculation": {"drafter": "suffix"}}).models.draft is None
    assert ("drafter: must be 'model', 'ngram', 'model+ngram', 'suffix', 'model+suffix', 'head', 'head+suffix' or "
            "'none', or a list of them (got 'eagle')") in config_error(with_section("speculation", {"drafter": "eagle"}))


def test_a_head_drafter_needs_a_head_and_a_head_needs_a_drafter_that_runs_it():
    """models.head is what the head kinds draft with: a head kind without one is refused naming the key, and so is
    a head that no drafter listed runs; a draft model and a head are served side by side, each kind its own."""
    message = config_error({"models": {"target": {"path": "t"}}, "speculation": {"drafter": ["suffix", "head"]}})
    assert "speculation.drafter 'head' needs models.head" in message
    message = config_error({"models": {"target": {"path": "t"}, "head": {"path": "h"}}, "speculation": {"drafter": "suffix"}})
    assert "models.head is given but no drafter runs it: list head or head+suffix in speculation.drafter" in message
    both = parse_config({"models": {"target": {"path": "t"}, "draft": {"path": "d"}, "head": {"path": "h"}},
                         "speculation": {"drafter": ["suffix", "model+ngram", "head+suffix"]},
                         "routing": {"task_types": {"chat": {"drafter": "head+suffix"}}}})
    assert both.models.head.path == "h" and set(both.speculation.shapes()) == {
        DrafterKind.SUFFIX, DrafterKind.MODEL_NGRAM, DrafterKind.HEAD_SUFFIX}
    assert both.speculation.shapes()[DrafterKind.HEAD_SUFFIX].nodes(4) == 1 + 4 + 4  # the head's chain and suffix's


# --- the live part: routing, as Serve's user_config ---


def routing_data(on_alpha: float = 0.55, code_off_alpha: float = 0.3) -> dict:
    return {"default": {"on_alpha": on_alpha}, "task_types": {"code": {"off_alpha": code_off_alpha}}}


def test_live_config_is_routing():
    routing = parse_live_config({"routing": routing_data(on_alpha=0.7)})
    assert routing.default.on_alpha == 0.7 and routing.thresholds("code").off_alpha == 0.3


@pytest.mark.parametrize("data, expected", [
    ({"routing": routing_data(on_alpha=0.2)},
     "user_config: routing.default.off_alpha: must be < on_alpha (0.35 >= 0.2)"),
    ({"routing": {"default": {"max_kk": 2}}},
     "user_config: routing.default.max_kk: extra key not allowed (did you mean 'max_k'?)"),
    ({"routing": routing_data(), "server": {"max_new_tokens": 5}},
     "user_config: server: cannot change while serving: only routing reloads live (the other sections need a redeploy)"),
    ({}, "user_config: routing: required key missing"),
    ("routing", "user_config: must be a mapping with one key, routing (got 'routing')"),
])
def test_live_config_refuses_whole_naming_the_key(data, expected):
    with pytest.raises(ConfigError) as info:
        parse_live_config(data)
    assert expected in str(info.value).splitlines()


def test_example_configs_say_their_gpus_are_logical():
    """configs/default.yaml and the shared pair's run small CPU models: Ray's GPUs there are logical slots."""
    assert load_config(DEFAULT_YAML, lambda needs: {"target": "t", "draft": "d"}).placement.logical_gpus is True
    assert load_config(SHARED_PAIR).placement.logical_gpus is True


def test_fractional_gpus_with_tensor_parallelism_are_refused():
    """Ray may pack two ranks of a tensor-parallel target on one GPU given fractional GPUs; NCCL refuses that."""
    message = config_error(with_section("placement", {"tensor_parallel_size": 2, "gpus_per_actor": 0.5}))
    assert message.startswith("ops.yaml: placement: gpus_per_actor 0.5 < 1 with tensor_parallel_size 2")
    assert "two target ranks on one GPU" in message and "NCCL" in message and "logical_gpus: true" in message


@pytest.mark.parametrize("placement", [
    {"tensor_parallel_size": 1, "gpus_per_actor": 0.5},  # one rank: no group to refuse it
    {"tensor_parallel_size": 2, "gpus_per_actor": 1.0},
    {"tensor_parallel_size": 2, "gpus_per_actor": 2.0},
    {"tensor_parallel_size": 2, "gpus_per_actor": 0.5, "logical_gpus": True},  # on the CPU: gloo, no NCCL
])
def test_whole_gpus_per_rank_or_logical_ones_are_allowed(placement):
    assert parse_config(with_section("placement", placement)).placement.gpus_per_actor == placement["gpus_per_actor"]


# --- what `specdec serve` and build_app run ---


def never_called(needs: frozenset = frozenset()) -> dict:
    raise AssertionError("the default pair was built although models were given")


def test_command_line_models_need_no_default_pair():
    cfg = app_config({"target": "t", "draft": "d"}, never_called)
    assert (cfg.models.target.path, cfg.models.draft.path, cfg.speculation.drafter) == ("t", "d", ["model+ngram"])
    cfg = app_config({"target": "t"}, never_called)
    assert cfg.models.draft is None and cfg.speculation.drafter == ["ngram"]  # as `specdec generate`
    with pytest.raises(ConfigError, match="--draft without --target"):
        app_config({"draft": "d"}, never_called)
    cfg = app_config({"target": "t", "draft": "d", "head": "h"}, never_called)  # both: the router chooses
    assert (cfg.models.head.path, cfg.speculation.drafter) == ("h", ["model+ngram", "head"])
    with pytest.raises(ConfigError, match="--head without --target"):
        app_config({"head": "h"}, never_called)


def test_no_models_given_uses_the_default_pair():
    cfg = app_config({}, lambda needs: {"target": "dt", "draft": "dd"})
    assert (cfg.models.target.path, cfg.models.draft.path) == ("dt", "dd")


def test_a_drafter_without_a_model_does_not_build_the_default_draft(tmp_path):
    asked = []

    def default_models(needs: frozenset) -> dict:
        asked.append(needs)
        return {"target": "dt", **({"draft": "dd"} if "draft" in needs else {}), **({"head": "dh"} if "head" in needs else {})}

    cfg = app_config({"drafter": "ngram"}, default_models)
    assert cfg.models.draft is None and cfg.speculation.drafter == ["ngram"] and asked == [frozenset()]
    path = tmp_path / "ops.yaml"
    path.write_text(yaml.safe_dump({"speculation": {"drafter": "none"}}))
    assert app_config({"config": str(path)}, default_models).models.draft is None and asked[-1] == frozenset()
    assert app_config({"config": str(path), "drafter": "model"}, default_models).models.draft.path == "dd"
    assert app_config({}, default_models).speculation.drafter == ["suffix", "model+ngram"] and asked[-1] == {"draft"}
    cfg = app_config({"drafter": "head"}, default_models)  # the default target's head, and no draft model
    assert (cfg.models.draft, cfg.models.head.path, asked[-1]) == (None, "dh", {"head"})
    path.write_text(yaml.safe_dump({"speculation": {"drafter": ["suffix", "model+ngram", "head+suffix"]}}))
    cfg = app_config({"config": str(path)}, default_models)
    assert (cfg.models.draft.path, cfg.models.head.path, asked[-1]) == ("dd", "dh", {"draft", "head"})


def test_serve_flags_override_the_file_and_are_checked_again(tmp_path):
    path = tmp_path / "ops.yaml"
    path.write_text(yaml.safe_dump({"models": {"target": {"path": "t", "dtype": "bfloat16"}}, "speculation": {"drafter": "ngram"}}))
    base = load_config(path)
    out = app_config({"config": str(path), "draft": "d", "draft_replicas": 3, "tensor_parallel_size": None,
                      "grpc_port": 9001}, never_called)
    assert out.models.draft.path == "d" and out.placement.draft_replicas == 3 and out.server.grpc_port == 9001
    assert out.models.draft.dtype == "float32" and out.models.target.dtype == "bfloat16"
    assert out.placement.tensor_parallel_size == base.placement.tensor_parallel_size  # None: not given
    with pytest.raises(ConfigError, match="server.http_port: must differ from grpc_port"):
        app_config({"config": str(path), "grpc_port": 8000}, never_called)
    assert base.placement.logical_gpus is False
    assert app_config({"config": str(path), "logical_gpus": True}, never_called).placement.logical_gpus is True
    assert app_config({"config": str(path), "logical_gpus": None}, never_called).placement.logical_gpus is False


# --- bounds (issue 22): the speculation's shape, task type names and count, request size --------------


@pytest.mark.parametrize("section, values, key, limit", [
    ("speculation", {"drafter": "ngram", "tree_width": 17}, "speculation.tree_width", 16),
    ("routing", {"default": {"max_k": 33}}, "routing.default.max_k", 32),
    ("routing", {"task_types": {"code": {"max_k": 1000}}}, "routing.task_types.code.max_k", 32),
    ("server", {"max_request_bytes": 2**31}, "server.max_request_bytes", 2**31 - 1),
    ("server", {"max_running_requests": 10**23}, "server.max_running_requests", 65536),  # a pool made at start
    ("server", {"max_kv_tokens": 2**40}, "server.max_kv_tokens", 2**32),
    ("server", {"max_new_tokens": 10**9}, "server.max_new_tokens", 10_000_000),
    ("server", {"max_n": 10**7}, "server.max_n", 1_000_000),
])
def test_shape_and_size_bounds_name_the_key(section, values, key, limit):
    assert f"ops.yaml: {key}: must be less than or equal to {limit}" in config_error(with_section(section, values))


def test_bounds_are_the_named_constants_and_their_edges_load():
    from specdec.drafter_kinds import MAX_DEPTH, MAX_TREE_WIDTH

    assert (MAX_TREE_WIDTH, MAX_DEPTH) == (16, 32)
    config = parse_config({**MINIMAL, "speculation": {"tree_width": MAX_TREE_WIDTH},
                           "routing": {"default": {"max_k": MAX_DEPTH}}})
    assert (config.speculation.tree_width, config.routing.default.max_k) == (16, 32)
    assert config.server.max_request_bytes == 4 * 1024 * 1024 and config.routing.max_task_types == 64
    assert load_config(SHARED_PAIR).server.max_request_bytes == 4194304


@pytest.mark.parametrize("name", ["a b", "x" * 65, "ünï", "default", "code/../x"])
def test_configured_task_type_names_are_held_to_the_request_rule(name):
    assert "ops.yaml: routing.task_types: " in config_error(with_section("routing", {"task_types": {name: {}}}))


def test_max_task_types_leaves_room_for_the_configured_ones():
    routing = {"task_types": {"code": {}, "prose": {}}, "max_task_types": 2}
    assert "ops.yaml: routing: max_task_types 2 leaves no room" in config_error(with_section("routing", routing))
    assert parse_config(with_section("routing", {**routing, "max_task_types": 3})).routing.max_task_types == 3
    assert parse_live_config({"routing": {"max_task_types": 5}}).max_task_types == 5  # live, as all of routing


def test_the_suffix_section_reaches_the_drafters_shape():
    config = parse_config({"models": {"target": {"path": "t"}},
                           "speculation": {"drafter": "suffix", "suffix": {"max_depth": 16, "min_token_prob": 0.2,
                                                                          "global_max_tokens": 5000}}})
    shape = config.speculation.shapes()["suffix"]
    assert shape.drafter == "suffix" and shape.nodes(8) == 9  # K guesses at most, no draft model
    assert (shape.suffix.max_depth, shape.suffix.min_token_prob, shape.suffix.global_max_tokens) == (16, 0.2, 5000)
    assert shape.suffix.max_spec_factor == 1.0  # the rest keep their defaults
    suffix = {"models": {"target": {"path": "t"}}, "speculation": {"drafter": "suffix"}}
    assert "speculation.suffix.min_token_prob: must be less than or equal to 1 (got 2)" in config_error(
        {**suffix, "speculation": {"drafter": "suffix", "suffix": {"min_token_prob": 2}}})
    assert "speculation.suffix.max_deph: extra key not allowed (did you mean 'max_depth'?)" in config_error(
        {**suffix, "speculation": {"drafter": "suffix", "suffix": {"max_deph": 3}}})


def test_several_drafters_are_listed_and_routing_names_only_those():
    two = {"models": {"target": {"path": "t"}, "draft": {"path": "d"}},
           "speculation": {"drafter": ["suffix", "model+ngram"]}}
    config = parse_config(two)
    assert config.speculation.kinds() == ("suffix", "model+ngram")
    assert list(config.speculation.shapes()) == ["suffix", "model+ngram"]
    pinned = {**two, "routing": {"task_types": {"code": {"drafter": "model+ngram", "forbid_drafters": ["suffix"]}}}}
    assert parse_config(pinned).routing.thresholds("code").drafter == "model+ngram"
    assert "routing.task_types.code.drafter: 'ngram' is not among the drafters served (speculation.drafter: " \
           "suffix, model+ngram)" in config_error({**two, "routing": {"task_types": {"code": {"drafter": "ngram"}}}})
    for drafter, problem in [([], "an empty list"), (["suffix", "none"], "none cannot be listed with other drafters"),
                             (["suffix", "suffix"], "a drafter is listed twice: suffix, suffix"),
                             (["suffix", "eagle"], "must be 'model', 'ngram', 'model+ngram', 'suffix', 'model+suffix', 'head', "
                              "'head+suffix' or 'none', or a list of them (got 'eagle')")]:
        assert f"speculation.drafter: {problem}" in config_error({**two, "speculation": {"drafter": drafter}})
    assert "speculation.drafter 'model' needs models.draft" in config_error(
        {"models": {"target": {"path": "t"}}, "speculation": {"drafter": ["suffix", "model"]}})


def test_suffix_corpora_are_named_by_task_type():
    base = {"models": {"target": {"path": "t"}}, "speculation": {"drafter": "suffix"}}
    config = parse_config({**base, "speculation": {"drafter": "suffix", "suffix": {"corpora": {"code": "/data/code"},
                                                                                   "corpus_max_tokens": 5000}}})
    assert config.speculation.suffix.corpora == {"code": "/data/code"}
    assert config.speculation.shapes()["suffix"].suffix.max_depth == 24  # the drafts' settings leave corpora out
    assert "speculation.suffix.corpora: task type 'a b'" in config_error(
        {**base, "speculation": {"drafter": "suffix", "suffix": {"corpora": {"a b": "/x"}}}})



@pytest.mark.parametrize("section, values, key", [
    ("placement", {"gpus_per_actor": float("inf")}, "placement.gpus_per_actor"),
    ("server", {"idle_row_timeout_s": float("inf")}, "server.idle_row_timeout_s"),
    ("routing", {"default": {"ema": float("nan")}}, "routing.default.ema"),
])
def test_no_float_is_infinite_or_nan(section, values, key):
    """YAML reads `.inf` and `.nan`: an infinite timeout or share passed, and a NaN passed where no bound was."""
    assert f"ops.yaml: {key}: must be a finite number" in config_error(with_section(section, values))


@pytest.mark.parametrize("text, where, key", [
    ("models: {target: {path: t}}\nserver: {max_n: 2}\nserver: {max_n: 3}\n", "3:1", "'server' (first at line 2)"),
    ("models:\n  target: {path: t}\nrouting:\n  task_types:\n    code: {max_k: 2}\n    code: {}\n", "6:5",
     "'code' (first at line 5)"),
])
def test_a_key_given_twice_is_refused_naming_both_lines(text, where, key):
    """YAML's loaders keep a repeated key's last value and drop the first silently: a second server section
    dropped the whole first one."""
    with pytest.raises(ConfigError, match=f"^ops.yaml:{where}: YAML syntax error: duplicate key {re.escape(key)}$"):
        parse_config(text, "ops.yaml")
    anchors = "shared: &s {max_n: 2}\nmodels: {target: {path: t}}\nserver: {<<: *s, max_n: 3}\n"
    assert "shared: extra key not allowed" in config_error(anchors)  # a merge key's keys may be overridden


@pytest.mark.parametrize("name, why", [("", "models.draft"), ("default", "models.draft"),
                                       ("code review", "may hold only")])
def test_a_task_draft_is_for_a_task_type_a_request_can_name(name, why):
    """models.task_drafts "" replaced models.draft silently, and a name no request may give was accepted."""
    data = {"models": {"target": {"path": "t"}, "task_drafts": {name: {"path": "d"}}}}
    assert "ops.yaml: models.task_drafts: " in config_error(data) and why in config_error(data)


def test_a_model_path_is_not_empty():
    assert "ops.yaml: models.target.path: " in config_error({"models": {"target": {"path": ""}}})


def test_a_corpus_that_is_missing_or_holds_no_file_is_named_before_the_actors_start(tmp_path):
    """Each draft replica reads its corpora as it starts, after the target took its GPUs: check_served_models
    names a missing one before (the replica's own error was clear, but late)."""
    import os

    from cluster.frontend import check_served_models

    target = tmp_path / "target"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(target)
    (tmp_path / "pipes").mkdir()
    os.mkfifo(tmp_path / "pipes" / "fifo")  # a named pipe is no file to read: opening it waits for a writer
    for path, why in [(tmp_path / "nowhere", "no such file or folder"), (tmp_path / "pipes", "holds no regular file")]:
        cfg = parse_config({"models": {"target": {"path": str(target)}},
                            "speculation": {"drafter": "suffix", "suffix": {"corpora": {"code": str(path)}}}})
        with pytest.raises(ValueError, match=f"^speculation.suffix.corpora.code: {re.escape(str(path))}: {why}"):
            check_served_models(cfg)

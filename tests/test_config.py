"""Operator config: validation with errors naming the file, key path and reason; live routing reload."""

import logging
import os
from pathlib import Path

import pytest
import yaml

from cluster.config import ConfigError, RoutingConfig, RoutingReloader, ServeConfig, load_config, parse_config

DEFAULT_YAML = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"
MINIMAL = {"models": {"target": {"path": "t"}}}


def with_section(section: str, values: dict) -> dict:
    return {**MINIMAL, section: values}


def config_error(data) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="ops.yaml")
    return str(info.value)


def test_default_yaml_loads():
    config = load_config(DEFAULT_YAML)
    assert config.models.target.path == "../shared/bench-models/target"
    assert config.models.draft.path == "../shared/bench-models/draft"
    assert set(config.routing.task_types) == {"code", "prose"}
    assert config.routing.thresholds("prose").on_alpha == 0.6
    assert config.routing.thresholds("poetry") == config.routing.default


def test_round_trip():
    config = load_config(DEFAULT_YAML)
    assert parse_config(yaml.safe_dump(config.model_dump())) == config
    assert parse_config(config.model_dump()) == config


def test_defaults():
    config = parse_config("models: {target: {path: t}}")
    assert config.models.target.dtype == "float32" and config.models.draft is None
    p = config.placement
    assert (p.tensor_parallel_size, p.draft_replicas, p.gpus_per_actor) == (1, 1, 1.0)
    assert config.speculation.drafter == "model+ngram" and config.speculation.num_speculative_tokens == "auto"
    assert (config.speculation.tree_width, config.speculation.max_depth) == (1, 8)
    t = config.routing.default
    assert (t.on_alpha, t.off_alpha, t.min_samples, t.probe_fraction, t.ema, t.max_k, t.draft_cost_ratio) == (
        0.55, 0.35, 20, 0.05, 0.1, 8, 0.15)
    assert config.routing.task_types == {}
    s = config.server
    assert (s.grpc_port, s.http_port) == (9000, 8000)
    assert (s.max_prompt_tokens, s.max_new_tokens, s.max_queued_requests) == (4096, 1024, 256)
    fixed = parse_config(with_section("speculation", {"num_speculative_tokens": 4}))
    assert fixed.speculation.num_speculative_tokens == 4


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
            " (allowed: tensor_parallel_size, draft_replicas, gpus_per_actor)",
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
            with_section("speculation", {"num_speculative_tokens": -1}),
            "ops.yaml: speculation.num_speculative_tokens: must be an integer >= 0 or 'auto' (got -1)",
        ),
        ({"placement": {}}, "ops.yaml: models: required key missing"),
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
        "ops.yaml: extra: extra key not allowed (allowed: models, placement, speculation, routing, server)",
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


# --- live reload of the routing section ---


class ConfigFile:
    """A config file whose every write gets a later mtime (file times are coarser than these tests)."""

    def __init__(self, path: Path, data: dict):
        self.path, self.mtime_ns = path, 1_000_000_000
        self.write(data)

    def write(self, data: dict | str) -> None:
        self.path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
        self.mtime_ns += 1_000_000_000
        os.utime(self.path, ns=(self.mtime_ns, self.mtime_ns))


def routing_data(on_alpha: float = 0.55, code_off_alpha: float = 0.3) -> dict:
    return {"default": {"on_alpha": on_alpha}, "task_types": {"code": {"off_alpha": code_off_alpha}}}


@pytest.fixture
def reload(tmp_path):
    """(config file, reloader, routings passed to on_change)."""
    file = ConfigFile(tmp_path / "serve.yaml", with_section("routing", routing_data()))
    applied: list[RoutingConfig] = []
    return file, RoutingReloader(file.path, applied.append, log=logging.getLogger("test.reload")), applied


def test_reloader_applies_changed_thresholds(reload):
    file, reloader, applied = reload
    assert isinstance(reloader.config, ServeConfig)
    assert reloader.check() is False and applied == []  # nothing changed yet
    file.write(with_section("routing", routing_data(on_alpha=0.7)))
    assert reloader.check() is True
    assert [r.default.on_alpha for r in applied] == [0.7]
    assert reloader.config.routing.default.on_alpha == 0.7
    assert reloader.check() is False and len(applied) == 1  # unchanged since


def test_reloader_ignores_a_rewrite_with_the_same_routing(reload):
    file, reloader, applied = reload
    file.write(with_section("routing", routing_data()) | {"placement": {}})  # same config, other bytes
    assert reloader.check() is False and applied == []


def test_reloader_keeps_config_on_broken_file_and_logs_once(reload, caplog):
    file, reloader, applied = reload
    running = reloader.config
    with caplog.at_level(logging.WARNING, logger="test.reload"):
        file.write(with_section("routing", routing_data(on_alpha=0.2)))  # off_alpha 0.35 >= 0.2
        assert reloader.check() is False
        assert reloader.check() is False
        file.write(with_section("routing", routing_data(on_alpha=0.2)))  # touched, same error
        assert reloader.check() is False
    assert applied == [] and reloader.config is running
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "keeping the running one" in errors[0].getMessage()
    assert f"{file.path}: routing.default.off_alpha: must be < on_alpha (0.35 >= 0.2)" in errors[0].getMessage()

    file.write("routing: [\n")  # a different problem is logged
    assert reloader.check() is False
    assert "YAML syntax error" in caplog.records[-1].getMessage()

    file.write(with_section("routing", routing_data(on_alpha=0.8)))  # fixed: picked up
    assert reloader.check() is True
    assert applied[-1].default.on_alpha == 0.8


def test_reloader_survives_the_file_going_missing(reload, caplog):
    file, reloader, applied = reload
    file.path.unlink()
    with caplog.at_level(logging.ERROR, logger="test.reload"):
        assert reloader.check() is False
        assert reloader.check() is False
    assert len(caplog.records) == 1 and "cannot read config file" in caplog.records[0].getMessage()
    file.write(with_section("routing", routing_data(code_off_alpha=0.1)))
    assert reloader.check() is True
    assert applied[-1].thresholds("code").off_alpha == 0.1


def test_reloader_warns_that_other_sections_need_a_restart(reload, caplog):
    file, reloader, applied = reload
    with caplog.at_level(logging.WARNING, logger="test.reload"):
        file.write(with_section("routing", routing_data()) | {"server": {"grpc_port": 9100}})
        assert reloader.check() is False
    assert applied == []
    assert reloader.config.server.grpc_port == 9000  # still what the server started with
    [record] = caplog.records
    assert record.levelno == logging.WARNING and "server" in record.getMessage() and "restart" in record.getMessage()


def test_reloader_refuses_a_broken_file_at_start(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("models: {}\n")
    with pytest.raises(ConfigError, match="models.target: required key missing"):
        RoutingReloader(path, lambda routing: None)


def test_serve_flags_override_the_file_and_are_checked_again():
    from cluster.serve_app import apply_overrides

    cfg = parse_config({"models": {"target": {"path": "t", "dtype": "bfloat16"}}})
    out = apply_overrides(cfg, {"draft": "d", "draft_replicas": 3, "tensor_parallel_size": None, "grpc_port": 9001})
    assert out.models.draft.path == "d" and out.placement.draft_replicas == 3 and out.server.grpc_port == 9001
    assert out.placement.tensor_parallel_size == cfg.placement.tensor_parallel_size  # None: not given
    with pytest.raises(ConfigError, match="server.http_port: must differ from grpc_port"):
        apply_overrides(cfg, {"grpc_port": 8000})

"""edge.yaml's `policy:` and `monitor:` sections: every knob of `PolicyConfig` and
`MonitorConfig` is settable, in either spelling, and reaches the running agent."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import pathlib
import re

import pytest
import yaml

from edge_agent.config import EdgeConfig, config_from_dict, load_config
from edge_agent.errors import ConfigError
from edge_agent.monitor import MonitorConfig
from edge_agent.policy import PolicyConfig
from edge_agent.runner import Runner

BASE = {"gateway": "127.0.0.1:50051", "model": "resnet50@1"}

#: Values for knobs whose default gives no valid different value by arithmetic.
CHOSEN = {"objective": "energy", "slo_ms": 250.0, "initial_up_bps": 5e6}


def _other_value(f: dataclasses.Field) -> object:
    """A valid value unlike the field's default, so a knob that never arrives is seen."""
    if f.name in CHOSEN:
        return CHOSEN[f.name]
    default = f.default
    assert isinstance(default, (int, float)) and not isinstance(default, bool), (
        f"add a value for the new knob {f.name!r} to CHOSEN")
    return default + 1 if isinstance(default, int) else default * 1.5


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


def _sections() -> dict[str, tuple[type, dict[str, object]]]:
    return {section: (cls, {f.name: _other_value(f) for f in dataclasses.fields(cls)})
            for section, cls in (("policy", PolicyConfig), ("monitor", MonitorConfig))}


def test_every_policy_and_monitor_knob_set_in_edge_yaml_reaches_the_runner(tmp_path) -> None:
    raw: dict[str, object] = dict(BASE)
    for section, (_, values) in _sections().items():
        # half the knobs camelCase, half snake_case: both spellings load
        raw[section] = {(_camel(k) if i % 2 else k): v for i, (k, v) in enumerate(values.items())}
    path = tmp_path / "edge.yaml"
    path.write_text(yaml.safe_dump(raw))
    config = load_config(str(path))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        runner = Runner(None, None, None, config, executor=pool, local_ms=5.0)  # type: ignore[arg-type]
        for section, (cls, values) in _sections().items():
            running = runner.policy_config if section == "policy" else runner.monitor.config
            assert running == cls(**values)
            for name, value in values.items():
                assert getattr(running, name) == value and type(getattr(running, name)) is type(value), name
    assert EdgeConfig.from_json(config.to_json()) == config


def test_the_documented_top_level_policy_keys_set_the_policy() -> None:
    c = config_from_dict(BASE | {"objective": "energy", "sloMs": 120, "hysteresis": 0.3, "dwell_s": 2})
    assert c.policy == PolicyConfig(objective="energy", slo_ms=120.0, hysteresis=0.3, dwell_s=2.0)


@pytest.mark.parametrize("raw, key", [
    ({"slo_ms": 100, "policy": {"slo_ms": 200}}, "policy.slo_ms"),
    ({"dwellS": 1, "policy": {"dwell_s": 2}}, "policy.dwell_s"),
    ({"policy": {"trial_ratio": 2, "trialRatio": 3}}, "policy.trialRatio"),
])
def test_a_knob_set_twice_is_refused(raw: dict, key: str) -> None:
    with pytest.raises(ConfigError, match="keep one") as e:
        config_from_dict(BASE | raw)
    assert e.value.key == key


@pytest.mark.parametrize("raw, key, value", [
    ({"policy": {"dwell_s": -1}}, "policy.dwell_s", "-1"),
    ({"policy": {"maxBackoff": 1.5}}, "policy.maxBackoff", "1.5"),
    ({"policy": {"trial_ratio": "fast"}}, "policy.trial_ratio", "'fast'"),
    ({"policy": {"objective": "speed"}}, "policy.objective", "'speed'"),
    ({"objective": "speed"}, "objective", "'speed'"),
    ({"slo_ms": -5}, "slo_ms", "-5"),
    ({"monitor": {"alpha": 2}}, "monitor.alpha", "2"),
    ({"monitor": {"stallFactor": 1}}, "monitor.stallFactor", "1"),
    ({"monitor": {"rtt_window": 0}}, "monitor.rtt_window", "0"),
    ({"monitor": {"floor_bps": True}}, "monitor.floor_bps", "True"),
])
def test_a_bad_knob_names_its_key_value_and_default(raw: dict, key: str, value: str) -> None:
    with pytest.raises(ConfigError) as e:
        config_from_dict(BASE | raw)
    msg = str(e.value)
    assert e.value.key == key and value in msg and "default" in msg and "\n" not in msg


def test_an_unknown_knob_in_a_section_suggests_the_right_one() -> None:
    with pytest.raises(ConfigError, match=re.escape("did you mean 'policy.trial_every_s'?")) as e:
        config_from_dict(BASE | {"policy": {"trial_every": 3}})
    assert e.value.key == "policy.trial_every"


def test_a_section_must_be_a_mapping_and_may_be_empty() -> None:
    with pytest.raises(ConfigError, match="not a mapping") as e:
        config_from_dict(BASE | {"monitor": 3})
    assert e.value.key == "monitor"
    assert config_from_dict(BASE | {"policy": None, "monitor": {}}) == config_from_dict(BASE)


def test_the_link_monitor_counts_bytes_at_the_frontiers_ratio() -> None:
    from planner import Frontier, LinkRange, Objective

    frontier = Frontier("m", Objective.LATENCY, LinkRange(1e6, 1e8, down_ratio=2.5), ())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        runner = Runner(None, frontier, None, config_from_dict(BASE), executor=pool,  # type: ignore[arg-type]
                        local_ms=5.0)
    assert runner.monitor.down_ratio == 2.5


def test_every_knob_has_a_row_in_the_docs_config_table() -> None:
    doc = (pathlib.Path(__file__).parents[2] / "docs" / "edge-agent.md").read_text(encoding="utf-8")
    for section, (cls, _) in _sections().items():
        for f in dataclasses.fields(cls):
            assert f"| `{section}.{f.name}`" in doc, f"docs/edge-agent.md has no row for {section}.{f.name}"

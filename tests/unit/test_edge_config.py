"""edge.yaml: loading, camelCase aliases, and an error naming the key and fix for each bad value."""

import pytest

from edge_agent.config import EdgeConfig, config_from_dict, default_cache_dir, load_config
from edge_agent.errors import ConfigError
from edge_agent.monitor import MonitorConfig
from edge_agent.policy import PolicyConfig

BASE = {"gateway": "127.0.0.1:50051", "model": "resnet50@1"}


def test_helm_configmap_keys_load(tmp_path):
    p = tmp_path / "edge.yaml"
    p.write_text("gateway: splitinfer-gateway.default.svc:50051\nmodel: resnet50@2\nobjective: energy\n"
                 "apiHost: 0.0.0.0\napiPort: 8600\n")
    c = load_config(str(p))
    assert (c.gateway, c.model_name, c.model_version, c.policy.objective, c.api_host, c.api_port) == (
        "splitinfer-gateway.default.svc:50051", "resnet50", "2", "energy", "0.0.0.0", 8600)


def test_defaults_and_bare_model_name():
    c = config_from_dict({"gateway": "gw:1", "model": "resnet50"})
    assert c.model_version == "" and c.api_host == "127.0.0.1" and c.api_port == 8500
    assert c.fallback == "local" and c.policy == PolicyConfig() and c.monitor == MonitorConfig()
    assert c.resolved_cache_dir == default_cache_dir()


def test_snake_and_camel_and_nested_tls(tmp_path):
    c = config_from_dict(BASE | {"sloMs": 150, "cache_dir": str(tmp_path), "tls": {"ca": "ca.pem"}})
    assert c.policy.slo_ms == 150.0 and isinstance(c.policy.slo_ms, float) and c.tls_ca == "ca.pem"


def test_json_round_trip_and_repr_hides_token():
    c = config_from_dict(BASE | {"token": "s3cret", "slo_ms": 90.5})
    assert EdgeConfig.from_json(c.to_json()) == c
    assert "s3cret" not in repr(c) and "token='set'" in repr(c)


@pytest.mark.parametrize("key", ["gateway", "model"])
def test_missing_required_key(key):
    raw = dict(BASE)
    del raw[key]
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw)
    assert e.value.key == key and "missing" in str(e.value)


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(ConfigError) as e:
        config_from_dict(BASE | {"slo_msec": 10})
    assert e.value.key == "slo_msec" and "slo_ms" in str(e.value)


@pytest.mark.parametrize("key,value", [
    ("gateway", "no-port"), ("model", "bad name!"), ("objective", "speed"), ("fallback", "retry"),
    ("slo_ms", -5), ("api_port", 70000), ("hysteresis", 1.5), ("breaker_failures", 0),
    ("remote_timeout_ms", 0), ("api_socket", ""), ("encodings", ["fp8"]), ("encodings", []),
])
def test_bad_values_name_key_and_value(key, value):
    with pytest.raises(ConfigError) as e:
        config_from_dict(BASE | {key: value})
    assert e.value.key == key and (repr(value) in str(e.value) or repr(tuple(value)) in str(e.value))


def test_tls_pairs_and_token_conflicts():
    with pytest.raises(ConfigError, match="tls_key"):
        config_from_dict(BASE | {"tls_ca": "a", "tls_cert": "c"})
    with pytest.raises(ConfigError, match="tls_ca"):
        config_from_dict(BASE | {"tls_cert": "c", "tls_key": "k"})
    with pytest.raises(ConfigError, match="token_file"):
        config_from_dict(BASE | {"token": "t", "token_file": "f"})


def test_token_file(tmp_path):
    f = tmp_path / "tok"
    f.write_text("abc\n")
    assert config_from_dict(BASE | {"tokenFile": str(f)}).read_token() == "abc"
    f.write_text("")
    with pytest.raises(ConfigError, match="empty"):
        config_from_dict(BASE | {"tokenFile": str(f)}).read_token()
    with pytest.raises(ConfigError, match="cannot be read"):
        config_from_dict(BASE | {"tokenFile": str(tmp_path / "none")}).read_token()


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("gateway: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))
    top = tmp_path / "list.yaml"
    top.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="not a mapping"):
        load_config(str(top))


def test_encodings_list():
    c = config_from_dict(BASE | {"encodings": ["fp16", "int8"]})
    assert c.encodings == ("fp16", "int8") and EdgeConfig.from_json(c.to_json()) == c


def test_recovery_probe_s_defaults_and_is_checked():
    base = {"gateway": "127.0.0.1:50051", "model": "m@1"}
    assert config_from_dict(base).recovery_probe_s == 0.5
    assert config_from_dict({**base, "recoveryProbeS": 1}).recovery_probe_s == 1.0
    with pytest.raises(ConfigError, match="recovery_probe_s"):
        config_from_dict({**base, "recovery_probe_s": 0})


@pytest.mark.parametrize("raw,first,second", [
    ({"sloMs": 100, "slo_ms": 200}, "sloMs", "slo_ms"),
    ({"api_port": 1, "apiPort": 2}, "api_port", "apiPort"),
    ({"tls_ca": "a.pem", "tls": {"ca": "b.pem"}}, "tls_ca", "tls.ca"),
])
def test_one_knob_given_twice_in_two_spellings_is_refused(raw, first, second):
    with pytest.raises(ConfigError) as e:
        config_from_dict(BASE | raw)
    msg = str(e.value)
    assert e.value.key == second and repr(first) in msg and "keep one" in msg and "\n" not in msg


def test_camel_and_snake_in_one_yaml_file_is_refused(tmp_path):
    p = tmp_path / "edge.yaml"
    p.write_text("gateway: gw:1\nmodel: m@1\nsloMs: 100\nslo_ms: 200\n")
    with pytest.raises(ConfigError, match=r"'slo_ms' repeats 'sloMs' \(both set 'policy.slo_ms'\)"):
        load_config(str(p))


def test_plain_duplicate_yaml_key_is_refused_with_both_lines(tmp_path):
    p = tmp_path / "edge.yaml"
    p.write_text("gateway: gw:1\nmodel: m@1\nslo_ms: 100\nslo_ms: 200\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(p))
    assert e.value.key == "slo_ms" and "lines 3 and 4" in str(e.value) and "keep one" in str(e.value)


def test_duplicate_key_inside_nested_tls_is_refused(tmp_path):
    p = tmp_path / "edge.yaml"
    p.write_text("gateway: gw:1\nmodel: m@1\ntls:\n  ca: a.pem\n  ca: b.pem\n")
    with pytest.raises(ConfigError, match="'ca' appears twice"):
        load_config(str(p))

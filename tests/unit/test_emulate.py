"""splitinfer.emulate: the link spec, the quota arithmetic, the cgroup files, the agent's config;
and the `emulate:` keys of edge.yaml and the `edge run` flags that set them."""

from __future__ import annotations

import argparse
import os

import pytest

from edge_agent.config import EdgeConfig, config_from_dict, load_config
from edge_agent.errors import ConfigError
from splitinfer import emulate
from splitinfer.emulate import CpuQuota, EmulatedLink, link_from_config, parse_link_spec, quota_cpus

BASE = {"gateway": "127.0.0.1:50151", "model": "squeezenet"}


def _cfg(**kw: object) -> EdgeConfig:
    return config_from_dict(dict(BASE, **kw))


# -- --emulate-link ------------------------------------------------------------------


def test_link_spec_sets_the_uplink_and_optional_rtt_and_downlink() -> None:
    assert parse_link_spec("10mbit") == {"emulate_uplink": "10mbit"}
    assert parse_link_spec("10mbit, rtt=5ms,down=40mbit") == {
        "emulate_uplink": "10mbit", "emulate_rtt": "5ms", "emulate_downlink": "40mbit"}


@pytest.mark.parametrize("spec, said", [
    ("rtt=5ms", "does not start with the uplink rate"),
    ("", "does not start with the uplink rate"),
    ("10mbit,jitter=3ms", "'jitter=3ms' is not rtt=DURATION or down=RATE"),
    ("10mbit,rtt=", "'rtt=' is not rtt=DURATION"),
    ("10mbit,rtt=5ms,rtt=6ms", "gives rtt twice"),
])
def test_link_spec_refuses_what_it_cannot_read(spec: str, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        parse_link_spec(spec)


def test_link_from_config_defaults_the_downlink_to_4x_and_the_rtt_to_0() -> None:
    assert link_from_config(_cfg()) is None
    assert link_from_config(_cfg(emulate={"uplink": "10mbit"})) == EmulatedLink(10e6, 40e6, 0.0)
    assert link_from_config(_cfg(emulate={"uplink": 2_000_000, "rtt": 20, "downlink": "3mbit"})) == \
        EmulatedLink(2e6, 3e6, 20.0)


@pytest.mark.parametrize("link, key, said", [
    ({"uplink": "5mbps"}, "emulate.uplink", "ambiguous between bits and bytes"),
    ({"uplink": "0mbit"}, "emulate.uplink", "not > 0"),
    ({"uplink": "10mbit", "rtt": "soon"}, "emulate.rtt", "cannot parse duration"),
    ({"uplink": "10mbit", "downlink": "0"}, "emulate.downlink", "not > 0"),
    ({"rtt": "5ms"}, "emulate.rtt", "set without emulate.uplink"),
])
def test_bad_link_settings_name_the_key(link: dict[str, object], key: str, said: str) -> None:
    with pytest.raises(ConfigError, match=said) as e:
        link_from_config(_cfg(emulate=link))
    assert e.value.key == key


# -- the quota -----------------------------------------------------------------------


def test_quota_is_the_ratio_of_this_hosts_time_to_the_devices() -> None:
    assert quota_cpus(47.0, 4.7) == pytest.approx(0.1)
    assert quota_cpus(10_000.0, 1.0) == 0.01  # floor: a device 100x slower than one core here
    assert quota_cpus(5.0, 10.0) == 0.0  # this host is slower already: no throttle
    assert quota_cpus(0.0, 3.0) == 0.0 and quota_cpus(3.0, 0.0) == 0.0


@pytest.fixture
def fake_v1(tmp_path, monkeypatch):
    """A directory standing in for the cgroup v1 CPU controller (no v2 mounted)."""
    monkeypatch.setattr(emulate, "_V2_ROOT", str(tmp_path / "none"))
    monkeypatch.setattr(emulate, "_V1_ROOT", str(tmp_path / "cpu"))
    (tmp_path / "cpu").mkdir()
    return tmp_path / "cpu"


def _read(path) -> str:
    return path.read_text().strip()


def test_a_quota_under_a_tenth_of_a_cpu_lengthens_the_period_to_keep_the_kernels_1ms_minimum(fake_v1) -> None:
    q = CpuQuota(0.05, "t1")
    assert q.active and q.kind == "cgroup v1"
    assert (_read(fake_v1 / "t1" / "cpu.cfs_period_us"), _read(fake_v1 / "t1" / "cpu.cfs_quota_us")) == ("20000", "1000")
    q2 = CpuQuota(0.15, "t2")  # the demo's default: the 10 ms period
    assert (_read(fake_v1 / "t2" / "cpu.cfs_period_us"), _read(fake_v1 / "t2" / "cpu.cfs_quota_us")) == ("10000", "1500")
    q.add(os.getpid())
    assert _read(fake_v1 / "t1" / "cgroup.procs") == str(os.getpid())
    (fake_v1 / "t1" / "cgroup.procs").unlink()  # a real cgroup's files go with it
    for f in ("cpu.cfs_period_us", "cpu.cfs_quota_us"):
        (fake_v1 / "t1" / f).unlink()
    q.remove()
    assert not (fake_v1 / "t1").exists() and q.path is None
    assert q2.active


def test_no_quota_says_why(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(emulate, "_V2_ROOT", str(tmp_path / "none"))
    monkeypatch.setattr(emulate, "_V1_ROOT", str(tmp_path / "none-either"))
    q = CpuQuota(0.1, "t")
    assert not q.active and "no writable cgroup CPU controller (none mounted)" in q.why_not
    off = CpuQuota(0, "t")
    assert not off.active and "off" in off.why_not
    off.remove()  # nothing to remove: no error


# -- the agent's config --------------------------------------------------------------


def test_the_agents_config_goes_to_the_emulator_with_one_thread_and_keeps_the_device() -> None:
    c = _cfg(emulate={"device": "rpi4", "uplink": "10mbit", "rtt": "5ms"}, intra_op_threads=4)
    child = emulate._child_config(c, "127.0.0.1:40000")
    assert child["gateway"] == "127.0.0.1:40000" and child["intra_op_threads"] == 1
    assert child["emulate_device"] == "rpi4"
    assert not {"emulate_uplink", "emulate_rtt", "emulate_downlink"} & set(child)
    again = config_from_dict(child)  # what the child reads back
    assert again.emulate_device == "rpi4" and again.emulate_uplink is None and again.encodings == c.encodings


@pytest.mark.parametrize("raw", [
    {"emulate": {"device": "rpi4"}},
    {"emulateDevice": "rpi4"},
    {"emulate_device": "rpi4"},
    {"emulate": {"Device": "rpi4"}},
])
def test_the_device_is_accepted_nested_flat_and_in_camel_case(raw: dict[str, object]) -> None:
    assert _cfg(**raw).emulate_device == "rpi4"


def test_an_unknown_device_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as e:
        _cfg(emulate={"device": "rpi44"})
    assert e.value.key == "emulate.device"
    assert "did you mean 'rpi4'?" in str(e.value) and "known devices: rpi4, rpi5, jetson-orin-nano" in str(e.value)


@pytest.mark.parametrize("raw, key, said", [
    ({"emulate": "rpi4"}, "emulate", "not a mapping"),
    ({"emulate": {"device": "rpi4"}, "emulateDevice": "rpi5"}, "emulateDevice", "repeats 'emulate.device'"),
    ({"emulate": {"device": "rpi4"}, "device_profile": "p.json"}, "emulate.device", "together with device_profile"),
    ({"emulate": {"device": ""}}, "emulate_device", "non-empty string"),
    ({"emulate": {"devce": "rpi4"}}, "emulate_devce", "did you mean 'emulate_device'?"),
])
def test_bad_emulate_keys_are_refused(raw: dict[str, object], key: str, said: str) -> None:
    with pytest.raises(ConfigError, match=said) as e:
        _cfg(**raw)
    assert e.value.key == key


def test_emulate_in_a_yaml_file(tmp_path) -> None:
    p = tmp_path / "edge.yaml"
    p.write_text("gateway: 127.0.0.1:50151\nmodel: squeezenet\nemulate:\n  device: rpi4\n  uplink: 100mbit\n"
                 "  rtt: 20ms\n")
    c = load_config(str(p))
    assert (c.emulate_device, c.emulate_uplink, c.emulate_rtt) == ("rpi4", "100mbit", "20ms")
    assert EdgeConfig.from_json(c.to_json()) == c


# -- edge run's flags ----------------------------------------------------------------


def _args(**kw: object) -> argparse.Namespace:
    d = {"config": None, "gateway": None, "model": None, "api_port": None, "api_socket": None,
         "emulate_device": None, "emulate_link": None}
    d.update(kw)
    return argparse.Namespace(**d)


def test_flags_alone_make_a_config_and_override_a_file(tmp_path) -> None:
    from splitinfer.edge_cmd import _load

    c = _load(_args(gateway="127.0.0.1:50151", model="squeezenet", api_port=8591, emulate_device="rpi4",
                    emulate_link=parse_link_spec("100mbit,rtt=20ms")))
    assert (c.api_port, c.emulate_device, c.emulate_uplink, c.emulate_rtt) == (8591, "rpi4", "100mbit", "20ms")
    p = tmp_path / "edge.yaml"
    p.write_text("gateway: 10.0.0.1:50051\nmodel: resnet50\nemulate: {device: rpi5, uplink: 5mbit, rtt: 9ms}\n")
    c = _load(_args(config=str(p), emulate_device="rpi4", emulate_link=parse_link_spec("10mbit")))
    assert (c.gateway, c.emulate_device, c.emulate_uplink, c.emulate_rtt) == ("10.0.0.1:50051", "rpi4", "10mbit", None)


def test_without_a_file_the_gateway_and_model_flags_are_needed() -> None:
    from splitinfer.edge_cmd import _load

    with pytest.raises(ConfigError, match="pass --config edge.yaml, or --gateway and --model"):
        _load(_args(gateway="127.0.0.1:50151"))
    with pytest.raises(ConfigError, match="'emulate.uplink' is '5mbps'"):
        _load(_args(gateway="127.0.0.1:50151", model="m", emulate_link=parse_link_spec("5mbps")))


# -- throttling the ready agent ------------------------------------------------------


class _Child:
    pid = 4242


def test_a_ready_agent_goes_into_the_quota_that_matches_the_device(fake_v1, caplog) -> None:
    caplog.set_level("INFO", logger="splitinfer.emulate")
    quota = emulate._throttle(_Child(), _cfg(emulate={"device": "rpi4"}),
                              {"local_ms": 47.2, "measured_local_ms": 4.72})
    assert quota is not None and quota.cpus == pytest.approx(0.1)
    assert _read(fake_v1 / "splitinfer-edge-4242" / "cgroup.procs") == "4242"
    assert "emulating rpi4: the agent runs with one thread in a cgroup v1 quota of 0.1 CPU" in caplog.text
    assert "10.0x" in caplog.text


def test_without_a_cgroup_the_agent_runs_unthrottled_and_says_by_how_much_it_is_faster(tmp_path, monkeypatch,
                                                                                       caplog) -> None:
    monkeypatch.setattr(emulate, "_V2_ROOT", str(tmp_path / "none"))
    monkeypatch.setattr(emulate, "_V1_ROOT", str(tmp_path / "none-either"))
    cfg = _cfg(emulate={"device": "rpi4"})
    assert emulate._throttle(_Child(), cfg, {"local_ms": 47.2, "measured_local_ms": 4.72}) is None
    assert "emulating rpi4: no writable cgroup CPU controller" in caplog.text
    assert "unthrottled, 10.0x faster than the rpi4 estimate" in caplog.text
    caplog.clear()
    assert emulate._throttle(_Child(), cfg, {"local_ms": 47.2, "measured_local_ms": 60.0}) is None
    assert "this host is not faster, so the agent runs unthrottled with one thread" in caplog.text

"""splitinfer.emulate and edge_agent.device: the link spec, the time-scaled device, the agent's
config; and the `emulate:` keys of edge.yaml and the `edge run` flags that set them."""

from __future__ import annotations

import argparse
import time

import pytest

from edge_agent.config import EdgeConfig, config_from_dict, load_config
from edge_agent.errors import ConfigError
from splitinfer import emulate
from splitinfer.emulate import EmulatedLink, link_from_config, parse_link_spec

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


# -- the time-scaled device ----------------------------------------------------------


def _spin(seconds: float) -> int:
    """Busy work of about `seconds` of this thread's CPU time."""
    n, t = 0, time.thread_time()
    while time.thread_time() - t < seconds:
        n += 1
    return n


def test_the_device_takes_factor_times_the_cpu_time_of_its_work() -> None:
    from edge_agent.device import SlowDevice

    dev = SlowDevice(5.0)
    t = time.perf_counter()
    out, ms = dev.run(lambda: _spin(0.01) and "done")
    wall_ms = (time.perf_counter() - t) * 1e3
    assert out == "done"
    assert ms >= 5 * 10 * 0.99 and wall_ms >= ms  # at least factor x the 10 ms of CPU it spent


def test_sleeping_is_not_work_a_slow_device_stretches() -> None:
    from edge_agent.device import SlowDevice

    dev = SlowDevice(20.0)
    _, ms = dev.run(lambda: time.sleep(0.02))  # 20 ms of waiting, almost no CPU
    assert ms < 20 * 20 / 4  # far from 20 x the wall time


def test_the_device_has_one_core() -> None:
    import threading

    from edge_agent.device import SlowDevice

    dev = SlowDevice(3.0)
    spans: list[tuple[float, float]] = []

    def work() -> None:
        _, _ = dev.run(lambda: spans.append((time.perf_counter(), _spin(0.005) and time.perf_counter())))

    threads = [threading.Thread(target=work) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    spans.sort()
    # each piece of work starts after the one before it ended, stretch included
    assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:]))


def test_a_keyed_piece_takes_factor_times_its_reference_not_its_own_cpu_time() -> None:
    from edge_agent.device import REFERENCE_RUNS, SlowDevice

    dev = SlowDevice(5.0)
    for _ in range(REFERENCE_RUNS):
        dev.run(lambda: _spin(0.004), key="k")
    ref = dev.reference_cpu_ms("k")
    assert ref is not None and 4 * 0.99 <= ref < 4 * 3  # the median of the first runs' CPU ms
    _, short_ms = dev.run(lambda: _spin(0.001), key="k")  # a quick run still takes the reference's time
    assert short_ms >= 5 * ref * 0.99
    _, spike_ms = dev.run(lambda: _spin(0.012), key="k")  # and a slow one no more than its own wall time
    assert 5 * ref * 0.99 <= spike_ms < 5 * 12  # each run against the reference: load moves each sleep's overshoot
    assert dev.reference_cpu_ms("k") == ref  # fixed after the first runs
    _, other_ms = dev.run(lambda: _spin(0.001), key="other")  # each key has its own
    assert other_ms < short_ms / 2


def test_a_cancelled_piece_frees_the_device_at_once_and_leaves_the_reference() -> None:
    import threading

    from edge_agent.device import REFERENCE_RUNS, SlowDevice
    from workers.engine import RunCancel
    from workers.errors import RunCancelledError

    dev = SlowDevice(1.0)
    for _ in range(REFERENCE_RUNS):
        dev.run(lambda: _spin(0.002), key="k")
    ref = dev.reference_cpu_ms("k")
    dev.set_factor(60_000.0)  # a piece of "k" now takes minutes
    started, cancel, raised = threading.Event(), RunCancel(), []

    def piece() -> None:
        try:
            dev.run(lambda: started.set(), key="k", cancel=cancel)
        except RunCancelledError as e:
            raised.append(e)

    th = threading.Thread(target=piece)
    th.start()
    assert started.wait(10)
    cancel.cancel()
    th.join(30)
    assert not th.is_alive() and len(raised) == 1  # out of its stretch, with the cancel's error
    assert dev.reference_cpu_ms("k") == ref
    ran = []
    with pytest.raises(RunCancelledError):  # cancelled before it starts: the work never runs
        dev.run(lambda: ran.append(1), key="k", cancel=cancel)
    assert ran == []
    dev.set_factor(1.0)
    assert dev.run(lambda: "next", key="k")[0] == "next"  # the device is free


def test_a_slowed_engine_keys_its_runs_by_engine_and_shapes(tmp_path) -> None:
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    from edge_agent.device import SlowDevice, SlowedEngine
    from workers.engine import Engine, EngineConfig

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])])
    path = str(tmp_path / "m.onnx")
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    cfg = EngineConfig(intra_op_threads=1, batch_buckets=(1, 4))
    dev = SlowDevice(1.0)
    a, b = SlowedEngine(Engine(path, cfg), dev), SlowedEngine(Engine(path, cfg), dev)
    assert a.reference_cpu_ms() is None
    a.run({"x": np.ones((1, 8), np.float32)})
    b.run({"x": np.ones((1, 8), np.float32)})
    a.run({"x": np.ones((3, 8), np.float32)})
    assert len(dev._cpu_s) == 3  # two engines at one shape, one engine at two
    assert a.reference_cpu_ms() == dev.reference_cpu_ms(a._last_key)


@pytest.mark.parametrize("factor", [0.5, 0, -1, float("nan"), float("inf"), "2"])
def test_a_slowdown_below_one_is_refused_with_the_fix(factor: object) -> None:
    from edge_agent.device import SlowDevice

    with pytest.raises(ValueError, match="give a number >= 1"):
        SlowDevice(factor)  # type: ignore[arg-type]


def test_a_slowed_engines_stats_report_the_devices_times(tmp_path) -> None:
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from edge_agent.device import SlowDevice, SlowedEngine
    from workers.engine import Engine, EngineConfig

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 256])], [w])
    path = str(tmp_path / "m.onnx")
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    engine = Engine(path, EngineConfig(intra_op_threads=1, batch_buckets=(1,), dynamic_batch=False))
    slowed = SlowedEngine(engine, SlowDevice(50.0))
    x = engine.random_inputs(1)
    for _ in range(3):
        slowed.run(x, copy=True)
    assert slowed.inputs == engine.inputs  # everything else is the engine's own
    assert slowed.stats().median_ms > 5 * engine.stats().median_ms


def test_emulate_slowdown_is_a_key_of_edge_yaml_and_a_flag() -> None:
    from splitinfer.edge_cmd import _load

    assert _cfg(emulate={"slowdown": 12}).emulate_slowdown == 12
    assert _load(_args(gateway="127.0.0.1:50151", model="m", emulate_slowdown=8.0)).emulate_slowdown == 8.0
    with pytest.raises(ConfigError, match="'emulate.slowdown' is 0.5; it must be a number >= 1"):
        _cfg(emulate={"slowdown": 0.5})
    with pytest.raises(ConfigError, match="together with emulate.device"):
        _cfg(emulate={"slowdown": 4, "device": "rpi4"})


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
         "emulate_device": None, "emulate_slowdown": None, "emulate_link": None}
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


def test_settling_the_device_takes_every_engines_reference_at_this_hosts_speed(tmp_path) -> None:
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from edge_agent.cache import ArtifactCache
    from edge_agent.device import REFERENCE_RUNS, SlowDevice
    from edge_agent.engines import ModelSet
    from partitioner import Cut

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((64, 64, 1, 1)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"), helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "w"], ["y"], name="conv2")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 32, 32])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, 32, 32])], initializer=[w])
    path = str(tmp_path / "m.onnx")
    onnx.save_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    device = SlowDevice(50.0)
    models = ModelSet(path, cache=ArtifactCache(str(tmp_path / "cache")), model="m", version="1", device=device)
    ce = models.load_cut(Cut(frozenset({models.graph.layers[0].id})))
    assert ce is not None and ce.head is not None
    # The empty cut's tail is the whole model's engine: one copy of the weights, one reference time.
    cloud_only = models.load_cut(Cut(frozenset()))
    assert cloud_only is not None and cloud_only.head is None and cloud_only.tail is models.full
    assert cloud_only.boundary == models.input_names and cloud_only.head_model_outputs == ()
    t = time.perf_counter()
    models.settle_device()
    engines = (models.full, ce.head, ce.tail)
    runs = REFERENCE_RUNS * len(engines)
    # unstretched (stretched 50x, the runs would take 50x their CPU time), and the factor back as it was
    assert (time.perf_counter() - t) * 1e3 < 50 * REFERENCE_RUNS * sum(e.reference_cpu_ms() for e in engines) / 5
    assert device.factor == 50.0
    assert all(len(seen) == REFERENCE_RUNS for seen in device._cpu_s.values()) and len(device._cpu_s) == 3
    assert runs == sum(len(seen) for seen in device._cpu_s.values())
    # Their times were this host's: the engines report none of them as the device's (the hedge reads them).
    assert all(e.stats().median_ms == 0.0 for e in engines)
    models.full.run({"x": np.zeros((1, 64, 32, 32), np.float32)})
    assert models.full.stats().median_ms >= 50 * models.full.reference_cpu_ms() * 0.99

"""The control API's request handling and the command line's argument errors (no network)."""

import asyncio
import json

import pytest

from splitinfer.netem import LinkEmulator, LinkSetting, NetemError, TraceStep, main

UPSTREAM = ("127.0.0.1", 9)  # never connected to: these tests serve nothing


def _emu(**kwargs):
    kwargs.setdefault("setting", LinkSetting.from_mbps(8, 32, 40))
    return LinkEmulator(upstream=UPSTREAM, **kwargs)


def _post(emu, path, payload):
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return emu.handle_control("POST", path, body)


def test_get_state_reports_the_setting_in_mbps_and_the_counters():
    status, state = _emu().handle_control("GET", "/state", b"")
    assert status == 200
    assert state["setting"] == {"up_mbps": 8.0, "down_mbps": 32.0, "rtt_ms": 40.0, "up": True}
    assert state["outage"] is False and state["outage_mode"] == "blackhole"
    assert state["stats"]["bytes_up"] == 0 and state["stats"]["connections_active"] == 0
    json.dumps(state)


def test_post_set_changes_only_the_fields_given():
    emu = _emu()
    status, state = _post(emu, "/set", {"up_mbps": 1.1, "rtt_ms": 100})
    assert status == 200
    assert emu.setting == LinkSetting(up_bps=1.1e6, down_bps=32e6, rtt_ms=100.0, up=True)
    assert state["setting"]["up_mbps"] == pytest.approx(1.1)
    status, state = _post(emu, "/set", {"up": 0})
    assert status == 200 and state["outage"] is True and emu.stats().outages == 1
    _post(emu, "/set", {"up": True})
    assert not emu.setting.is_outage


def test_zero_bandwidth_is_an_outage():
    emu = _emu()
    _post(emu, "/set", {"down_mbps": 0})
    assert emu.setting.is_outage and not emu.link_is_up


@pytest.mark.parametrize(
    ("method", "path", "payload", "status", "text"),
    [
        ("POST", "/set", {"up_kbps": 5}, 400, "up_kbps"),
        ("POST", "/set", {"up_mbps": -1}, 400, "-1"),
        ("POST", "/set", {"up_mbps": "fast"}, 400, "fast"),
        ("POST", "/set", {"up": 2}, 400, "2"),
        ("POST", "/set", b"{not json", 400, "not JSON"),
        ("POST", "/set", [1, 2], 400, "JSON object"),
        ("GET", "/set", {}, 405, "POST /set"),
        ("POST", "/state", {}, 405, "GET /state"),
        ("GET", "/nope", {}, 404, "/state"),
        ("POST", "/replay", {"loop": "yes"}, 400, "loop"),
        ("POST", "/replay", {}, 409, "no trace"),
    ],
)
def test_bad_control_requests_get_an_error_naming_the_value_and_the_fix(method, path, payload, status, text):
    emu = _emu()
    before = emu.setting
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    got_status, answer = emu.handle_control(method, path, body)
    assert got_status == status
    assert text in answer["error"] + answer["fix"]
    assert emu.setting == before


def test_set_stops_a_trace_replay_and_replay_restarts_it():
    async def scenario():
        trace = [TraceStep(0.0, LinkSetting.from_mbps(10, 40, 20)), TraceStep(60.0, LinkSetting.from_mbps(1, 4, 20))]
        emu = LinkEmulator(upstream=UPSTREAM, trace=trace)
        emu.replay()
        await asyncio.sleep(0)
        assert emu.state()["trace"]["replaying"] is True
        emu.set(rtt_ms=5.0)
        assert emu.state()["trace"]["replaying"] is False and emu.setting.rtt_ms == 5.0
        status, state = _post(emu, "/replay", {"loop": True})
        await asyncio.sleep(0.01)
        assert status == 200 and state["trace"]["loop"] is True
        assert emu.setting == trace[0].setting
        emu.set(up=False)

    asyncio.run(scenario())


def test_emulator_needs_exactly_one_of_setting_or_trace():
    with pytest.raises(NetemError, match="setting="):
        LinkEmulator(upstream=UPSTREAM)
    with pytest.raises(NetemError, match="setting="):
        LinkEmulator(upstream=UPSTREAM, setting=LinkSetting(1.0, 1.0), trace=[TraceStep(0.0, LinkSetting(1.0, 1.0))])


def test_emulator_rejects_unknown_outage_mode():
    with pytest.raises(NetemError, match="'drop'.*'blackhole' or 'reset'"):
        _emu(outage_mode="drop")


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (["--upstream", "127.0.0.1:1", "--up", "1mbit"], "--listen"),
        (["--listen", "127.0.0.1:0", "--upstream", "localhost", "--up", "1mbit"], "HOST:PORT"),
        (["--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:1", "--up", "fast"], "'fast'"),
        (["--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:1", "--up", "1mbit", "--rtt", "soon"], "'soon'"),
        (["--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:1"], "--trace CSV, or --up"),
        (["--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:1", "--trace", "demo", "--up", "1mbit"], "not both"),
        (["--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:1", "--up", "1mbit", "--outage-mode", "x"], "blackhole"),
    ],
)
def test_main_rejects_bad_arguments(argv, text, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert text in capsys.readouterr().err


def test_main_reports_a_bad_trace_file_and_returns_2(tmp_path, capsys):
    path = tmp_path / "bad.csv"
    path.write_text("t_s,up_mbps,down_mbps,rtt_ms,up\n0,1,4,20,7\n")
    assert main(["--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:1", "--trace", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2:" in err and "write 1 or 0" in err


def test_main_reports_an_unknown_shipped_trace(capsys):
    assert main(["--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:1", "--trace", "dialup"]) == 2
    assert "no shipped trace named 'dialup'" in capsys.readouterr().err

"""Trace CSV loading, the shipped traces and trace replay positions (no network)."""

import json

import pytest

from splitinfer.netem import (
    LinkSetting,
    NetemError,
    NetemStats,
    TraceFormatError,
    TraceStep,
    LinkEmulator,
    load_trace,
    main,
    resolve_trace,
    setting_at,
    shipped_trace_names,
    shipped_trace_path,
    trace_position,
)

HEADER = "t_s,up_mbps,down_mbps,rtt_ms,up\n"


def _write(tmp_path, text):
    path = tmp_path / "trace.csv"
    path.write_text(text)
    return path


def test_load_trace_reads_rows_comments_and_blank_lines(tmp_path):
    path = _write(tmp_path, "# a comment\n" + HEADER + "0,18.88,75.52,20,1\n\n# outage\n10,0,0,100,0\n 15 , 5.85 , 23.4 , 50 , 1 \n")
    steps = load_trace(path)
    assert [s.t_s for s in steps] == [0.0, 10.0, 15.0]
    assert steps[0].setting == LinkSetting(up_bps=18.88e6, down_bps=75.52e6, rtt_ms=20.0, up=True)
    assert steps[1].setting.is_outage and not steps[1].setting.up
    assert steps[2].setting.up_bps == pytest.approx(5.85e6)


@pytest.mark.parametrize(
    ("body", "line", "value", "fix"),
    [
        ("", 1, "", "header"),
        ("t_s,up,down,rtt,up\n0,1,4,20,1\n", 1, "t_s,up,down,rtt,up", "first line must be"),
        (HEADER, 1, "", "add at least one row"),
        (HEADER + "0,1,4,20\n", 2, "0,1,4,20", "on every row"),
        (HEADER + "0,1,4,20,1\n5,fast,4,20,1\n", 3, "fast", "up_mbps"),
        (HEADER + "0,1,4,-20,1\n", 2, "-20", "rtt_ms"),
        (HEADER + "0,1,4,nan,1\n", 2, "nan", "rtt_ms"),
        (HEADER + "0,1,4,20,2\n", 2, "2", "write 1 or 0"),
        (HEADER + "1,1,4,20,1\n", 2, "1", "t_s = 0"),
        (HEADER + "0,1,4,20,1\n5,1,4,20,1\n5,2,8,20,1\n", 4, "5", "sort the rows"),
        (HEADER + "0,1,4,20,1\n5,1,4,20,1\n3,2,8,20,1\n", 4, "3", "sort the rows"),
    ],
)
def test_load_trace_errors_name_file_line_value_and_fix(tmp_path, body, line, value, fix):
    path = _write(tmp_path, body)
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    error = info.value
    assert isinstance(error, ValueError) and isinstance(error, NetemError)
    assert error.path == str(path) and error.line == line and error.value == value
    assert str(error).startswith(f"{path}:{line}: ")
    assert fix in str(error)


def test_load_trace_missing_file_says_so(tmp_path):
    with pytest.raises(NetemError, match="no trace file at .*missing.csv.*shipped traces: 3g, 4g"):
        load_trace(tmp_path / "missing.csv")


def test_shipped_traces_use_the_dads_uplink_figures_and_4x_downlink():
    expected_up_mbps = {"cat1": 0.13, "3g": 1.1, "4g": 5.85, "wifi": 18.88}
    for name, up_mbps in expected_up_mbps.items():
        setting = load_trace(shipped_trace_path(name))[0].setting
        assert setting.up_bps == pytest.approx(up_mbps * 1e6)
        assert setting.down_bps == pytest.approx(4 * setting.up_bps)
        assert 5 <= setting.rtt_ms <= 100
    fast = load_trace(shipped_trace_path("5g"))[0].setting
    assert fast.up_bps > 18.88e6 and 5 <= fast.rtt_ms <= 100


def test_demo_trace_is_wifi_then_3g_then_a_10s_outage_then_4g():
    steps = load_trace(shipped_trace_path("demo"))
    ups = [s.setting.up_bps / 1e6 if not s.setting.is_outage else 0.0 for s in steps[:-1]]
    assert ups == pytest.approx([18.88, 1.1, 0.0, 5.85])
    durations_s = [b.t_s - a.t_s for a, b in zip(steps, steps[1:])]
    assert durations_s[2] == 10.0
    assert all(10 <= d <= 15 for d in durations_s)


def test_shipped_trace_path_unknown_name_lists_the_known_ones():
    with pytest.raises(NetemError, match="no shipped trace named 'dialup'.*shipped traces: .*demo"):
        shipped_trace_path("dialup")


def test_shipped_trace_names_are_the_csv_files_of_the_package():
    assert shipped_trace_names() == ["3g", "4g", "5g", "cat1", "demo", "wifi"]


@pytest.mark.parametrize("spec", ["4g", "4g.csv", "splitinfer/traces/4g.csv"])
def test_trace_resolves_shipped_names_from_any_directory(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_trace(spec) == shipped_trace_path("4g")
    assert load_trace(spec)[0].setting.up_bps == pytest.approx(5.85e6)


def test_trace_an_existing_file_wins_over_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "4g").write_text(HEADER + "0,1,4,20,1\n")
    assert resolve_trace("4g").resolve() == (tmp_path / "4g").resolve()
    assert load_trace("4g")[0].setting.up_bps == pytest.approx(1e6)


def test_trace_a_missing_file_elsewhere_is_not_taken_for_the_shipped_one(tmp_path):
    with pytest.raises(NetemError, match="no trace file at .*mine/4g.csv.*did you mean '4g'"):
        resolve_trace(tmp_path / "mine" / "4g.csv")


@pytest.mark.parametrize(("spec", "close"), [("4G", "4g"), ("wfi", "wifi"), ("demo.cvs", "demo"), ("cat-1", "cat1")])
def test_unknown_trace_name_suggests_the_closest_shipped_one(spec, close, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(NetemError) as info:
        resolve_trace(spec)
    message = str(info.value)
    assert f"did you mean {close!r}?" in message
    assert "shipped traces: 3g, 4g, 5g, cat1, demo, wifi" in message and "\n" not in message


def test_netem_command_unknown_trace_prints_one_line_and_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:1", "--trace", "4G"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("splitinfer netem: error: no shipped trace named '4G'")
    assert "did you mean '4g'?" in err and "3g, 4g, 5g, cat1, demo, wifi" in err


def test_netem_help_lists_the_shipped_trace_names(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "3g, 4g, 5g, cat1, demo, wifi" in " ".join(capsys.readouterr().out.split())


def test_link_emulator_takes_a_trace_by_name_or_path(tmp_path):
    by_name = LinkEmulator(upstream=("127.0.0.1", 1), trace="3g")
    assert by_name.setting.up_bps == pytest.approx(1.1e6)
    path = _write(tmp_path, HEADER + "0,2,8,20,1\n")
    assert LinkEmulator(upstream=("127.0.0.1", 1), trace=path).setting.up_bps == pytest.approx(2e6)
    with pytest.raises(NetemError, match="did you mean '3g'"):
        LinkEmulator(upstream=("127.0.0.1", 1), trace="3gg")


def _steps():
    a, b, c = (LinkSetting.from_mbps(m, 4 * m, 20) for m in (10, 1, 5))
    return [TraceStep(0.0, a), TraceStep(10.0, b), TraceStep(15.0, c)], (a, b, c)


def test_trace_position_without_loop_holds_the_last_row():
    steps, (a, b, c) = _steps()
    assert trace_position(steps, 0.0) == (0, 10.0)
    assert trace_position(steps, 9.99) == (0, 10.0)
    assert trace_position(steps, 10.0) == (1, 15.0)
    assert trace_position(steps, 15.0) == (2, None)
    assert setting_at(steps, 1e6) == c


def test_trace_position_with_loop_restarts_at_the_last_rows_time():
    steps, (a, b, c) = _steps()
    assert trace_position(steps, 14.0, loop=True) == (1, 15.0)
    assert trace_position(steps, 15.0, loop=True) == (0, 25.0)
    assert trace_position(steps, 26.0, loop=True) == (1, 30.0)
    assert setting_at(steps, 15.0 * 7 + 3, loop=True) == a
    single = [TraceStep(0.0, a)]
    assert trace_position(single, 50.0, loop=True) == (0, None)


def test_trace_position_needs_steps():
    with pytest.raises(NetemError, match="load_trace"):
        trace_position([], 0.0)


@pytest.mark.parametrize(
    ("field", "value"),
    [("up_bps", -1.0), ("down_bps", float("inf")), ("rtt_ms", float("nan")), ("up_bps", "fast"),
     ("up_bps", True), ("up", 1)],
)
def test_link_setting_rejects_bad_values_naming_them(field, value):
    kwargs = dict({"up_bps": 1.0, "down_bps": 1.0}, **{field: value})
    with pytest.raises(NetemError) as info:
        LinkSetting(**kwargs)
    assert f"LinkSetting.{field}" in str(info.value)
    assert f"got {value!r}" in str(info.value)


def test_link_setting_outage_rules():
    assert not LinkSetting(1.0, 1.0).is_outage
    assert LinkSetting(0.0, 1.0).is_outage
    assert LinkSetting(1.0, 0.0).is_outage
    assert LinkSetting(1.0, 1.0, up=False).is_outage
    assert LinkSetting(1.0, 1.0, up=False).describe() == "outage"


def test_values_round_trip_through_json_exactly():
    setting = LinkSetting(up_bps=18.88e6, down_bps=75.52e6, rtt_ms=20.5, up=False)
    assert LinkSetting.from_json(json.loads(json.dumps(setting.to_json()))) == setting
    step = TraceStep(t_s=12.5, setting=setting)
    assert TraceStep.from_json(json.loads(json.dumps(step.to_json()))) == step
    stats = NetemStats(bytes_up=5, bytes_down=7, outages=2, connections_refused=1)
    assert NetemStats.from_json(json.loads(json.dumps(stats.to_json()))) == stats

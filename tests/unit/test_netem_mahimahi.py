"""Mahimahi traces: loading, the opportunity link's arithmetic, and the options that take them (no network)."""

import asyncio

import pytest

from splitinfer.netem import (
    DEFAULT_QUEUE_BYTES,
    PACKET_BYTES,
    LinkEmulator,
    LinkSetting,
    MahimahiTrace,
    NetemError,
    OpportunityLink,
    TraceFormatError,
    load_mahimahi_trace,
    main,
)

UPSTREAM = ("127.0.0.1", 1)


def _write(tmp_path, text, name="link.up"):
    path = tmp_path / name
    path.write_text(text)
    return path


def _trace(*times_ms):
    return MahimahiTrace(path="t", opportunities_ms=tuple(times_ms))


def test_load_reads_repeated_times_and_skips_blank_lines(tmp_path):
    trace = load_mahimahi_trace(_write(tmp_path, "0\n0\n\n5\n 7 \n1000\n"))
    assert trace.opportunities_ms == (0, 0, 5, 7, 1000)
    assert trace.period_ms == 1000
    assert trace.mean_bps == pytest.approx(5 * 1500 * 8)


@pytest.mark.parametrize(
    ("body", "line", "value", "fix"),
    [
        ("1\n2\nfast\n", 3, "fast", "one whole number"),
        ("1\n-4\n", 2, "-4", "one whole number"),
        ("1\n2.5\n", 2, "2.5", "one whole number"),
        ("5\n9\n7\n", 3, "7", "sort the lines"),
        ("", 1, "", "one line per 1500-byte"),
        ("\n\n", 2, "", "one line per 1500-byte"),
        ("0\n0\n", 2, "0", "after 0 ms"),
    ],
)
def test_load_errors_name_the_file_the_line_and_the_fix(tmp_path, body, line, value, fix):
    path = _write(tmp_path, body)
    with pytest.raises(TraceFormatError) as info:
        load_mahimahi_trace(path)
    assert (info.value.path, info.value.line, info.value.value) == (str(path), line, value)
    assert str(info.value).startswith(f"{path}:{line}:") and fix in str(info.value)


def test_load_missing_file_says_so(tmp_path):
    with pytest.raises(NetemError, match="cannot read Mahimahi trace .*nope.up"):
        load_mahimahi_trace(tmp_path / "nope.up")


def test_a_scaled_trace_keeps_its_instants_and_carries_k_times_the_opportunities():
    trace = _trace(0, 0, 7, 400, 400, 400, 1000)   # 2, 1, 3 and 1 opportunities at four instants
    fast = trace.scaled(3)
    assert fast.opportunities_ms == (0,) * 6 + (7,) * 3 + (400,) * 9 + (1000,) * 3
    assert fast.period_ms == trace.period_ms and fast.mean_bps == pytest.approx(3 * trace.mean_bps)
    half = trace.scaled(0.5)   # by each instant, half the original's count, rounded down
    assert half.opportunities_ms == (0, 400, 400, 1000) and half.period_ms == trace.period_ms
    assert set(trace.scaled(1.5).opportunities_ms) == set(trace.opportunities_ms)
    # A second without opportunities stays empty: an outage is an outage at any rate.
    gap = _trace(*([0] * 10 + [2500] * 10 + [3000]))
    assert gap.scaled(4).count_between(1000, 2000) == 0 and gap.scaled(4).count_between(2000, 3000) == 40
    assert trace.scaled(1) is trace


@pytest.mark.parametrize("factor", [0, -1, float("nan"), float("inf")])
def test_a_trace_scaled_by_no_positive_number_is_refused(factor):
    with pytest.raises(NetemError, match="rate factor must be a number > 0"):
        _trace(0, 10).scaled(factor)


def test_count_between_counts_the_repeats():
    trace = _trace(0, 0, 5, 10)  # period 10 ms, 4 opportunities per period
    assert trace.count_between(0, 10) == 3  # the one at 10 ms is outside [0, 10)
    assert trace.count_between(0, 30) == 11
    assert trace.count_between(0, 31) == 14  # 30 ms: the end of period 2 and the start of period 3
    assert trace.count_between(10, 11) == 3  # 10 (end of period 0), and 10 + 0 twice
    assert trace.count_between(6, 9) == 0


def test_each_opportunity_delivers_1500_bytes_in_order():
    link = OpportunityLink(_trace(0, 0, 5, 10), start_s=100.0, tick_ms=0.0)
    pieces = link.reserve(4000, arrival_s=100.0)
    assert pieces == [(100.0, 3000), (100.005, 1000)]
    assert link.backlog_bytes(now_s=100.0) == 1000
    assert link.backlog_bytes(now_s=100.005) == 0


def test_the_rest_of_an_opportunity_serves_bytes_already_queued():
    link = OpportunityLink(_trace(0, 0, 5, 10), start_s=0.0, tick_ms=0.0)
    link.reserve(1000, arrival_s=0.0)
    assert link.reserve(500, arrival_s=0.0) == [(0.0, 500)]
    assert link.reserve(500, arrival_s=0.0) == [(0.0, 500)]  # second opportunity at 0 ms


def test_an_opportunity_that_finds_the_queue_empty_is_lost():
    link = OpportunityLink(_trace(0, 0, 5, 10), start_s=0.0, tick_ms=0.0)
    link.reserve(100, arrival_s=0.0)
    # Arriving at 6 ms: the rest of the 0 ms opportunities and the 5 ms one went unused.
    assert link.reserve(1500, arrival_s=0.006) == [(0.010, 1500)]
    # The trace repeats: next opportunities at 10 + 0 ms (twice), then 10 + 5 ms.
    assert link.reserve(4500, arrival_s=0.006) == [(0.010, 3000), (0.015, 1500)]


def test_opportunities_within_a_tick_are_merged_into_one_piece():
    link = OpportunityLink(_trace(*range(1, 11)), start_s=0.0, tick_ms=1.0)
    pieces = link.reserve(10 * PACKET_BYTES, arrival_s=0.0)
    assert sum(n for _, n in pieces) == 10 * PACKET_BYTES
    assert [n // PACKET_BYTES for _, n in pieces] == [2, 2, 2, 2, 2]
    assert [round(t * 1000) for t, _ in pieces] == [2, 4, 6, 8, 10]


def test_queueing_delay_grows_when_the_offered_load_exceeds_the_trace():
    link = OpportunityLink(_trace(*range(10, 1010, 10)), start_s=0.0)  # 100 packets/s = 1.2 Mbit/s
    leave_s = [link.reserve(PACKET_BYTES, arrival_s=i * 0.005)[-1][0] for i in range(100)]  # offered 2x
    delays_s = [t - i * 0.005 for i, t in enumerate(leave_s)]
    assert delays_s[0] == pytest.approx(0.010)
    assert delays_s[-1] == pytest.approx(0.505)
    assert all(b >= a for a, b in zip(delays_s, delays_s[1:]))


def test_room_at_is_when_the_backlog_falls_to_the_limit():
    link = OpportunityLink(_trace(*range(10, 1010, 10)), start_s=0.0)
    link.reserve(5 * PACKET_BYTES, arrival_s=0.0)
    assert link.backlog_bytes(now_s=0.0) == 5 * PACKET_BYTES
    assert link.room_at_s(5 * PACKET_BYTES, now_s=0.0) == 0.0
    assert link.room_at_s(3 * PACKET_BYTES, now_s=0.0) == pytest.approx(0.020)
    assert link.room_at_s(0, now_s=0.0) == pytest.approx(0.050)


def test_end_of_stream_leaves_after_the_bytes_queued_before_it():
    link = OpportunityLink(_trace(10, 20), start_s=0.0)
    link.reserve(3000, arrival_s=0.0)
    assert link.reserve(0, arrival_s=0.0) == [(pytest.approx(0.020), 0)]


def test_emulator_on_mahimahi_traces_reports_mean_rates_and_the_queue(tmp_path):
    up = _write(tmp_path, "0\n500\n1000\n", "x.up")
    down = _write(tmp_path, "1000\n", "x.down")
    emu = LinkEmulator(upstream=UPSTREAM, trace_up=up, trace_down=down, rtt_ms=40.0)
    assert emu.setting == LinkSetting(up_bps=36000.0, down_bps=12000.0, rtt_ms=40.0)
    state = emu.state()["mahimahi"]
    assert state["queue_bytes"] == DEFAULT_QUEUE_BYTES and state["up"]["opportunities"] == 3
    assert state["shaping"] is False  # not started


def test_set_hands_the_link_to_a_fixed_setting_and_replay_restores_the_traces(tmp_path):
    trace = _trace(5, 10)

    async def scenario():
        emu = LinkEmulator(upstream=UPSTREAM, trace_up=trace, trace_down=trace, rtt_ms=10.0)
        emu.replay()
        assert emu.opportunity_link("up") is not None and emu.state()["mahimahi"]["shaping"]
        emu.set(up_bps=1e6)
        assert emu.opportunity_link("up") is None and emu.setting.up_bps == 1e6
        emu.replay()
        assert emu.opportunity_link("down") is not None and emu.setting.up_bps == trace.mean_bps

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"trace_up": _trace(10)}, "both trace_up= and trace_down="),
        ({"trace_up": _trace(10), "trace_down": _trace(10), "setting": LinkSetting(1.0, 1.0)}, "exactly one of"),
        ({"setting": LinkSetting(1.0, 1.0), "rtt_ms": 20.0}, "rtt_ms= goes with"),
        ({"trace_up": _trace(10), "trace_down": _trace(10), "queue_bytes": 100}, "queue_bytes must be"),
    ],
)
def test_emulator_rejects_bad_mahimahi_arguments(kwargs, text):
    with pytest.raises(NetemError, match=text):
        LinkEmulator(upstream=UPSTREAM, **kwargs)


@pytest.mark.parametrize(
    ("extra", "text"),
    [
        (["--trace-up", "{up}"], "give both --trace-up FILE and --trace-down FILE"),
        (["--trace-up", "{up}", "--trace-down", "{up}", "--up", "1mbit"], "take only --rtt"),
        (["--trace-up", "{up}", "--trace-down", "{up}", "--loop"], "always repeats"),
        (["--up", "1mbit", "--queue-packets", "10"], "Mahimahi traces only"),
        (["--trace-up", "{up}", "--trace-down", "{up}", "--queue-packets", "0"], "at least one packet"),
        (["--trace-up", "{up}", "--trace-down", "{up}", "--queue-bytes", "1", "--queue-packets", "2"],
         "not allowed with"),
        (["--trace-up", "{up}", "--trace-down", "{up}", "--rate-scale", "0"], "--rate-scale is 0.0; it must be"),
        (["--up", "1mbit", "--rate-scale", "2"], "--rate-scale scales Mahimahi traces only"),
    ],
)
def test_netem_command_rejects_bad_mahimahi_options(tmp_path, capsys, extra, text):
    up = _write(tmp_path, "10\n")
    argv = ["--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:1"] + [a.format(up=up) for a in extra]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert text in capsys.readouterr().err


def test_netem_command_names_the_file_and_line_of_a_bad_mahimahi_trace(tmp_path, capsys):
    up = _write(tmp_path, "10\n20\n", "a.up")
    down = _write(tmp_path, "10\n30\n20\n", "a.down")
    assert main(["--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:1",
                 "--trace-up", str(up), "--trace-down", str(down)]) == 2
    err = capsys.readouterr().err
    assert f"{down}:3:" in err and "must not decrease" in err and "'20'" in err

"""The sweep plot names lines that coincide, and draws the chain scan visibly on the DAG optimum."""

import pytest

from splitinfer.plots import compute_sweep_labels, draw_sweep, plot_sweep

UPS_BPS = [1e5, 1e6, 1e7, 1e8]


def _sweep(chain, dag=(120.0, 100.0, 40.0, 20.0)):
    return {"model": "m", "objective": "latency", "metric": "total_ms", "edge_device": "rpi4",
            "cloud_device": "t4", "rtt_ms": 20.0, "uplink_bps": UPS_BPS,
            "series": {"edge_only": [120.0] * 4, "cloud_only": [900.0, 150.0, 40.0, 20.0],
                       "chain": list(chain), "dag": list(dag)},
            "breakpoints": [{"up_bps": 2e6, "above": {"edge_layers": 3}, "exact": True}],
            "max_gain": {"vs_chain": 1.0, "vs_best_single_tier": 1.2}}


def test_sweep_legend_says_the_chain_scan_equals_the_dag_optimum_at_every_rate():
    labels = compute_sweep_labels(_sweep(chain=(120.0, 100.00001, 40.0, 20.0))["series"])
    assert labels["chain"] == "chain scan (Neurosurgeon) = DAG optimum at every rate"
    assert labels["dag"] == "DAG optimum (ours)"
    assert labels["edge_only"] == "edge only" and labels["cloud_only"] == "cloud only"


def test_sweep_legend_counts_the_rates_where_the_chain_scan_equals_the_dag_optimum():
    labels = compute_sweep_labels(_sweep(chain=(120.0, 130.0, 60.0, 20.0))["series"])
    assert labels["chain"] == "chain scan (Neurosurgeon) = DAG optimum at 2 of 4 rates"


def test_sweep_legend_leaves_lines_that_differ_everywhere_plain():
    labels = compute_sweep_labels(_sweep(chain=(121.0, 130.0, 60.0, 21.0))["series"])
    assert labels["chain"] == "chain scan (Neurosurgeon)"


def test_sweep_legend_names_any_series_equal_to_one_before_it():
    series = _sweep(chain=(121.0, 130.0, 60.0, 21.0), dag=(900.0, 150.0, 40.0, 20.0))["series"]
    assert compute_sweep_labels(series)["dag"] == "DAG optimum (ours) = cloud only at every rate"


def test_sweep_figure_draws_the_chain_scan_dashed_above_the_dag_optimum_with_the_legend():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    fig = draw_sweep(_sweep(chain=(120.0, 100.0, 40.0, 20.0)))
    try:
        ax = fig.axes[0]
        lines = {line.get_gid(): line for line in ax.get_lines() if line.get_gid()}
        chain, dag = lines["chain"], lines["dag"]
        assert list(chain.get_ydata()) == list(dag.get_ydata())
        assert chain.get_zorder() > dag.get_zorder()
        assert chain.get_linestyle() not in ("-", "solid") and dag.get_linestyle() == "-"
        texts = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "chain scan (Neurosurgeon) = DAG optimum at every rate" in texts
    finally:
        plt.close(fig)


def test_plot_sweep_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "out" / "sweep.png"
    assert plot_sweep(_sweep(chain=(120.0, 100.0, 40.0, 20.0)), str(path)) == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

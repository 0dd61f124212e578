"""The e2e benchmark's regret figure is faceted: bounded in width however large the grid."""

import pytest

from bench._e2e_report import REGRET_DPI, draw_regret, regret_layout

MAX_WIDTH_PX = 2500


@pytest.mark.parametrize(("n_models", "n_ups", "n_rtts"), [(9, 7, 3), (3, 4, 1), (12, 10, 5), (40, 30, 8), (1, 1, 1)])
def test_regret_layout_is_at_most_2500_px_wide_with_a_panel_per_model_and_rtt(n_models, n_ups, n_rtts):
    nrows, ncols, (width_in, height_in) = regret_layout(n_models, n_ups, n_rtts)
    assert width_in * REGRET_DPI <= MAX_WIDTH_PX
    assert nrows * ncols >= n_models * n_rtts > (nrows - 1) * ncols
    assert height_in > 0


def _grid(n_models, ups_mbps, rtts_ms):
    models, cells = [], []
    for k in range(n_models):
        name = f"model{k}"
        links = [{"up_bps": u * 1e6, "rtt_ms": r} for r in rtts_ms for u in ups_mbps]
        models.append({"model": name, "links": links})
        for lk in links:
            cells.append({"model": name, "up_mbps": lk["up_bps"] / 1e6, "oracle_ms": 10.0,
                          "regret": {"edge-only": 2.0, "neurosurgeon": 1.2, "dads": 1.2, "ours": 1.0},
                          "regret_at_least": {"cloud-only": 40.0}})
    return models, {"cells": cells}


def test_regret_figure_draws_the_layout_one_titled_panel_per_model_and_rtt():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    models, summary = _grid(3, [1.1, 5.85, 18.88], [5.0, 50.0])
    fig = draw_regret(models, summary)
    try:
        assert tuple(fig.get_size_inches()) == pytest.approx(regret_layout(3, 3, 2)[2])
        panels = [ax for ax in fig.axes if ax.get_visible()]
        assert sorted(ax.get_title() for ax in panels) == sorted(
            f"model{k}, RTT {r:g} ms" for k in range(3) for r in (5.0, 50.0))
        assert all([t.get_text() for t in ax.get_xticklabels()] == ["1.1", "5.85", "18.88"] for ax in panels)
    finally:
        plt.close(fig)


def test_regret_figure_refuses_cells_that_do_not_match_the_links():
    models, summary = _grid(2, [1.0, 5.0], [20.0])
    summary["cells"] = summary["cells"][::-1]
    with pytest.raises(ValueError, match="recompute it with compute_summary"):
        draw_regret(models, summary)

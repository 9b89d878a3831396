"""Report plots: a single load point is drawn as bars, not as a lone dot; the waterfall's labels
stay inside its axes, its CIs are whiskers and its title is shown."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest
from matplotlib.container import BarContainer, ErrorbarContainer

from flashlane.bench import plots

PNG = b"\x89PNG"


@pytest.fixture
def figures():
    made = []
    yield made
    for fig in made:
        plt.close(fig)


def _point(x, tph, p90, tok):
    return {"x": x, "tasks_per_hour": tph, "task_p90_s": p90, "output_tok_s": tok}


def _long_lines(ax) -> list:
    return [ln for ln in ax.get_lines() if len(ln.get_xdata()) > 1]


def _inside(fig, ax, text) -> bool:
    renderer = fig.canvas.get_renderer()
    box, frame = text.get_window_extent(renderer), ax.get_window_extent(renderer)
    return frame.y0 <= box.y0 and box.y1 <= frame.y1 and frame.x0 <= box.x0 and box.x1 <= frame.x1


def test_a_single_load_point_is_a_bar_per_series_with_its_value(figures):
    points = {"flash": [_point(1, 4.17, 906.0, 55.2)], "standard": [_point(1, 8.8, 432.0, None)]}
    fig = plots.sweep_figure(points, x_label="concurrency (sessions in flight)")
    figures.append(fig)
    fig.canvas.draw()
    for ax, (key, _, unit) in zip(fig.axes, plots.SWEEP_METRICS):
        assert not _long_lines(ax)
        bars = [c for c in ax.containers if isinstance(c, BarContainer)]
        assert len(bars) == 1 and len(bars[0]) == 2
        labels = [t.get_text() for t in ax.texts]
        want = [plots._num(plots._value(p[0][key])) for p in points.values()]
        assert labels == want
        assert all(_inside(fig, ax, t) for t in ax.texts)
        assert ax.get_ylabel() == unit and ax.get_xlabel().endswith("= 1")
        assert [t.get_text() for t in ax.get_xticklabels()] == ["flash", "standard"]
    assert "n/a" in [t.get_text() for t in fig.axes[2].texts]     # the missing throughput
    assert plots.sweep(points)[:4] == PNG


def test_two_or_more_load_points_are_lines_with_markers(figures):
    points = {"flash": [_point(4, 12.0, 1200.0, 150.0), _point(1, 4.17, 906.0, 55.2)],
              "standard": [_point(1, 8.8, 432.0, 40.0), _point(4, 20.0, 700.0, 160.0)]}
    fig = plots.sweep_figure(points, x_label="concurrency (sessions in flight)")
    figures.append(fig)
    for ax, (_, _, unit) in zip(fig.axes, plots.SWEEP_METRICS):
        lines = _long_lines(ax)
        assert len(lines) == 2 and all(ln.get_marker() == "o" for ln in lines)
        assert list(lines[0].get_xdata()) == [1, 4]                     # sorted by load
        assert not ax.patches
        assert ax.get_ylabel() == unit and ax.get_xlabel() == "concurrency (sessions in flight)"


def _steps():
    return [
        {"stack": "naive", "hybrid_s": 50.0, "standard_s": 100.0, "ratio": 0.5, "ratio_low": 0.4,
         "ratio_high": 0.62, "d_ratio": None},
        # the tallest thing is this whisker: its label must still fit under the top
        {"stack": "hybrid-cache-gap", "hybrid_s": 50.0, "standard_s": 20.0, "ratio": 2.5, "ratio_low": 2.1,
         "ratio_high": 3.4, "d_ratio": 2.0},
        {"stack": "flashlane", "hybrid_s": 10.0, "standard_s": 20.0, "ratio": 0.5, "ratio_low": None,
         "ratio_high": None, "d_ratio": -2.0},
    ]


def test_waterfall_labels_sit_inside_the_axes_above_their_bars(figures):
    steps = _steps()
    fig = plots.ratio_waterfall_figure(steps, "flash", "standard")
    figures.append(fig)
    fig.canvas.draw()
    ax = fig.axes[1]
    low, high = ax.get_ylim()
    assert [t.get_text() for t in ax.texts] == ["0.50×", "2.50× (+2.00)", "0.50× (-2.00)"]
    for t, s, below in zip(ax.texts, steps, (0.5, 2.5, 2.5)):
        y = t.get_position()[1]
        assert max(below, s["ratio_high"] or 0) < y < high and low == 0
        assert _inside(fig, ax, t)


def test_waterfall_draws_each_known_ci_as_a_whisker(figures):
    steps = _steps()
    ax = plots.ratio_waterfall_figure(steps, "flash", "standard").axes[1]
    figures.append(ax.figure)
    whiskers = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert len(whiskers) == 2                                   # flashlane has no CI
    for c, s in zip(whiskers, steps[:2]):
        (seg,) = c.lines[2][0].get_segments()
        assert [p[1] for p in seg] == pytest.approx([s["ratio_low"], s["ratio_high"]])


def test_waterfall_title(figures):
    title = "per-task latency ratio at concurrency 1"
    fig = plots.ratio_waterfall_figure(_steps(), "flash", "standard", title=title)
    figures.append(fig)
    assert fig.axes[1].get_title() == title
    untitled = plots.ratio_waterfall_figure(_steps(), "flash", "standard")
    figures.append(untitled)
    assert untitled.axes[1].get_title() == ""
    assert plots.ratio_waterfall(_steps(), "flash", "standard", title=title)[:4] == PNG

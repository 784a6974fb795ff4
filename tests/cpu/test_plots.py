"""Issue 31.5: what the pictures say -- the plan timeline's legend names only the span kinds that
appear and labels the GEMM lanes' idle gaps; the bench bar chart's y-axis fits its bars."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")


@pytest.fixture
def saved_figures(monkeypatch):
    """The figures written by savefig, kept open for inspection."""
    from matplotlib.figure import Figure

    figures = []
    real = Figure.savefig

    def keep(self, *args, **kwargs):
        figures.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return figures


def test_plan_timeline_legend_names_what_appears(tmp_path, saved_figures):
    from tpfuse.model.hardware import get_profile
    from tpfuse.model.simulate import draw_timeline
    from tpfuse.strategies import simulate

    res = simulate("ag_gemm", "copy_engine", m=16384, n=7168, k=8192, world_size=4, dtype="bf16",
                   hw=get_profile("h200"), num_chunks=4)
    draw_timeline(res, tmp_path / "sub" / "t.png")
    assert (tmp_path / "sub" / "t.png").stat().st_size > 0
    legend = [t.get_text() for t in saved_figures[-1].axes[0].get_legend().get_texts()]
    kinds = {t.kind for t in res.tasks if t.duration > 0 and t.engine in ("gemm", "comm")}
    assert {"reduce", "flag"}.isdisjoint(kinds)            # this schedule has neither ...
    assert {"reduce", "flag"}.isdisjoint(legend)           # ... so the legend names neither
    assert kinds <= set(legend)
    gemm_spans = sorted(((t.rank, t.start, t.end) for t in res.tasks if t.engine == "gemm" and t.duration > 0))
    gaps = any(b[1] - a[2] > res.makespan_ms / 200 for a, b in zip(gemm_spans, gemm_spans[1:]) if a[0] == b[0]) or \
        any(start > res.makespan_ms / 200 for r in range(4) for (_, start, _) in [min(s for s in gemm_spans if s[0] == r)])
    # the GEMM lanes' idle gaps are labelled exactly when there are some
    assert gaps == any(text.startswith("idle: ") for text in legend)


def _row(cell, strategy, ms, unfused, gemm, comm):
    return {"cell": cell, "strategy": strategy, "ms": ms, "unfused_ms": unfused, "asynctp_ms": None,
            "gemm_ms": gemm, "comm_ms": comm}


def test_bench_png_y_axis_fits_the_bars(tmp_path, saved_figures):
    from tpfuse.bench.report import draw_speedups

    # speedups below 1.2, a roofline at 3.0 (comm tiny next to the GEMM): the axis must not run to 3
    rows = [_row("c1", "ring", 1.0, 1.1, 0.4, 0.05), _row("c1", "unfused", 1.05, 1.1, 0.4, 0.05),
            _row("c2", "ring", 2.0, 1.8, 0.6, 0.1)]
    meta = {"device": "CPU", "processes": 2, "mode": "cpu-gloo"}
    draw_speedups({"meta": meta, "rows": rows}, tmp_path / "s.png")
    ax = saved_figures[-1].axes[0]
    bars = max(p.get_height() for p in ax.patches)
    assert bars == pytest.approx(1.1)
    assert ax.get_ylim()[1] < 1.5
    assert any("roofline 2.8x" in t.get_text() for t in ax.texts)   # the clipped roofline keeps its value

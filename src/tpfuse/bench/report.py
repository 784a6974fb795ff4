"""Bench results for people: the speedup bar chart of ``tpfuse bench --png`` and the markdown
table of ``--md`` (what BENCHMARKS.md quotes: date, hardware, mode and command above the table).

matplotlib is an optional dependency (``pip install 'tpfuse[cli]'``); :func:`require_matplotlib`
raises one clear error before a long run starts rather than after it.
"""

from __future__ import annotations

from pathlib import Path

from tpfuse.timeline import save_figure

__all__ = ["require_matplotlib", "draw_speedups", "to_markdown"]


def require_matplotlib():
    """``matplotlib.pyplot`` on the Agg backend, or ``RuntimeError`` saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("PNG output needs matplotlib, which is not installed: "
                           "pip install 'tpfuse[cli]' (or pip install matplotlib)") from exc
    return plt


def _baseline(rows: list[dict]) -> str | None:
    """The baseline field the chart divides by: ``unfused_ms`` where measured (GPU, CPU), else
    ``asynctp_ms`` (the one-GPU bed, where the group cannot carry the collective), else None."""
    for field in ("unfused_ms", "asynctp_ms"):
        if any(r[field] is not None for r in rows):
            return field
    return None


def draw_speedups(result: dict, path: str | Path) -> Path:
    """Bars: ``baseline / ms`` per strategy per cell, baseline = ``unfused_ms`` (collective +
    torch.matmul; PyTorch async-TP gets a hatched bar of its own) or, where that was not measured
    (the one-GPU bed), ``asynctp_ms``.  A black tick per cell marks the roofline
    ``baseline / max(gemm_ms, comm_ms)``: the most any overlap of the two can give.  Raises
    ``ValueError`` when no row has a baseline."""
    plt = require_matplotlib()
    rows = result["rows"]
    base = _baseline(rows)
    if base is None:
        raise ValueError("no row has unfused_ms or asynctp_ms: nothing to draw speedups against")
    cells = list(dict.fromkeys(r["cell"] for r in rows))
    series = list(dict.fromkeys(r["strategy"] for r in rows))
    if base == "unfused_ms" and any(r["asynctp_ms"] is not None for r in rows):
        series.append("asynctp")
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(cells) * max(1, len(series))), 4.5))
    tallest = 1.0
    for j, name in enumerate(series):
        xs, ys = [], []
        for i, cell in enumerate(cells):
            mine = [r for r in rows if r["cell"] == cell]
            r = mine[0] if name == "asynctp" else next((r for r in mine if r["strategy"] == name), None)
            ms = None if r is None else (r["asynctp_ms"] if name == "asynctp" else r["ms"])
            if r is not None and ms and r[base]:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(r[base] / ms)
        ax.bar(xs, ys, width=width, label=name, hatch="//" if name == "asynctp" else None)
        tallest = max([tallest, *ys])
    top = 1.2 * tallest   # the axis fits the bars; a roofline above it is drawn at the top with its value
    for i, cell in enumerate(cells):
        r = next(r for r in rows if r["cell"] == cell)
        floor = max(r["gemm_ms"] or 0.0, r["comm_ms"] or 0.0)
        if r[base] and floor > 0:
            label = "roofline: baseline / max(gemm, comm)" if r["comm_ms"] is not None else "baseline / gemm (comm not measured)"
            roof = r[base] / floor
            ax.hlines(min(roof, top * 0.97), i - 0.45, i + 0.45, colors="black", linewidth=2,
                      linestyles="solid" if roof <= top else "dotted", label=label if i == 0 else None)
            if roof > top:
                ax.text(i, top * 0.93, f"roofline {roof:.1f}x", ha="center", va="top", fontsize=7)
    ax.set_ylim(0, top)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(cells)), cells, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("speedup vs " + ("collective + torch.matmul" if base == "unfused_ms" else "PyTorch async-TP"))
    meta = result["meta"]
    ax.set_title(f"tpfuse bench: {meta['device']}, {meta['processes']} processes, {meta['mode']}", fontsize=9)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def to_markdown(title: str, table: list[list[str]], meta: dict, notes: dict[str, str] | None = None) -> str:
    """``table`` (header + rows, as the CLI prints it) as a markdown section: a title, one line
    of provenance (date, device, processes, mode, versions, command), the table, then one line
    per null field with its reason."""
    versions = f"torch {meta.get('torch')}, triton {meta.get('triton')}, tpfuse {meta.get('tpfuse')}"
    lines = [f"### {title}", "",
             f"{meta.get('date')} · {meta.get('device')} · {meta.get('processes', 1)} process(es), "
             f"{meta.get('backend') or 'no process group'} · mode `{meta.get('mode')}` ({meta.get('mode_note')}) · "
             f"{versions} · `{meta.get('command')}`", ""]

    def cells(row: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |"

    lines.append(cells(table[0]))
    lines.append("|" + "|".join("---" for _ in table[0]) + "|")
    lines += [cells(row) for row in table[1:]]
    if notes:
        lines.append("")
        lines += [f"- `{field}` null: {why}" for field, why in notes.items()]
    return "\n".join(lines) + "\n"

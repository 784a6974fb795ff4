"""Pictures of bench results: the speedup bar chart of ``tpfuse bench --png``.

matplotlib is an optional dependency (``pip install 'tpfuse[cli]'``); :func:`require_matplotlib`
raises one clear error before a long run starts rather than after it.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["require_matplotlib", "draw_speedups"]


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


def draw_speedups(result: dict, path: str | Path) -> Path:
    """Bars: ``unfused_ms / ms`` per strategy per cell (and PyTorch async-TP's, where it ran); a
    black tick per cell at the roofline ``unfused_ms / max(gemm_ms, comm_ms)``, the most any
    overlap of the two can give.  Cells without an ``unfused_ms`` are drawn against ``gemm``."""
    plt = require_matplotlib()
    rows = result["rows"]
    cells = list(dict.fromkeys(r["cell"] for r in rows))
    names = list(dict.fromkeys(r["strategy"] for r in rows))
    has_asynctp = any(r["asynctp_ms"] is not None for r in rows)
    series = names + (["asynctp"] if has_asynctp else [])
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(cells) * max(1, len(series)) * 0.5), 4.5))
    for j, name in enumerate(series):
        xs, ys = [], []
        for i, cell in enumerate(cells):
            mine = [r for r in rows if r["cell"] == cell]
            if name == "asynctp":
                r = mine[0]
                value = r["unfused_ms"] / r["asynctp_ms"] if r["unfused_ms"] and r["asynctp_ms"] else None
            else:
                r = next((r for r in mine if r["strategy"] == name), None)
                value = r["speedup_vs_unfused"] if r else None
            if value is not None:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(value)
        label = name if name != "auto" else "auto"
        ax.bar(xs, ys, width=width, label=label, hatch="//" if name == "asynctp" else None)
    for i, cell in enumerate(cells):
        r = next(r for r in rows if r["cell"] == cell)
        floor = max(r["gemm_ms"] or 0.0, r["comm_ms"] or 0.0)
        if r["unfused_ms"] and floor > 0 and r["comm_ms"] is not None:
            ax.hlines(r["unfused_ms"] / floor, i - 0.45, i + 0.45, colors="black", linewidth=2,
                      label="roofline: unfused / max(gemm, comm)" if i == 0 else None)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(cells)), cells, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("speedup vs collective + torch.matmul")
    meta = result["meta"]
    ax.set_title(f"tpfuse bench: {meta['device']}, {meta['processes']} processes, {meta['mode']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

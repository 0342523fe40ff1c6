"""The benchmark's picture (matplotlib, imported only when drawing): per network, step time against
memory kept and against the peak, one point per mode, the front of modes nothing beats on both
marked; below, the memory timeline of one step per mode. Labels are placed off markers and text.
"""
from __future__ import annotations

import math
import sys

from .presets import MODES, sizes_in
from .report import fmt_bytes, pareto_front

# One colour per mode, the same in every panel; compiled modes share their eager mode's hue.
_COLOURS = {"plain": "#555555", "compile": "#999999", "checkpoint": "#1f77b4",
            "checkpoint-reentrant": "#17becf", "checkpoint-stack": "#6a3d9a",
            "compile-checkpoint": "#9e9ac8", "fused": "#d62728", "compile-fused": "#fc8d59",
            "checkpoint-fused": "#8c564b", "liger": "#2ca02c", "unsloth": "#e377c2"}


def _place_labels(ax, xy: list[tuple[float, float]], labels: list[str], colours: list[str]):
    """Annotate each point with its label at the first of a ring of offsets (growing outwards)
    where the text (and its leader line, for far offsets) overlaps no other label and no marker,
    and stays inside the axes."""
    from matplotlib.text import Text

    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    to_disp = ax.transData.transform
    ax_box = ax.get_window_extent(renderer)
    px = fig.dpi / 72.0
    # Points that land on one another (within 6 px) share one label, a name per line.
    groups: list[list[int]] = []
    for i, p in enumerate(xy):
        d = to_disp(p)
        for g in groups:
            if math.dist(d, to_disp(xy[g[0]])) < 6 * px:
                g.append(i)
                break
        else:
            groups.append([i])
    xy = [xy[g[0]] for g in groups]
    colours = [colours[g[0]] if len(g) == 1 else "#333333" for g in groups]
    labels = ["\n".join(labels[i] for i in g) for g in groups]
    markers = [to_disp(p) for p in xy]
    taken = []
    dirs = [(1, 0.3), (1, -1), (-1, 0.3), (-1, -1), (0, 1.2), (0, -1.8), (1, 1.2), (-1, 1.2),
            (1, -1.8), (-1, -1.8), (0.5, 2.2), (-0.5, 2.2), (0.5, -2.6), (-0.5, -2.6)]
    for i in sorted(range(len(xy)), key=lambda j: (xy[j][0], xy[j][1])):
        best = None
        for r in (6, 12, 20, 30, 42, 56, 72):
            for dx, dy in dirs:
                ha = "left" if dx > 0 else "right" if dx < 0 else "center"
                t = ax.annotate(labels[i], xy[i], xytext=(dx * r, dy * r * 0.8),
                                textcoords="offset points", ha=ha, va="center", fontsize=7.5,
                                color=colours[i],
                                arrowprops=(dict(arrowstyle="-", color=colours[i], lw=0.6,
                                                 shrinkA=0, shrinkB=3) if r >= 12 else None))
                # the text's own box (an Annotation's would include its leader line), once the
                # annotation has placed its text
                t.update_positions(renderer)
                bb = Text.get_window_extent(t, renderer).expanded(1.04, 1.15)
                inside = (bb.x0 >= ax_box.x0 and bb.x1 <= ax_box.x1 and bb.y0 >= ax_box.y0
                          and bb.y1 <= ax_box.y1)
                pad = 4 * px  # keep clear of every marker, the label's own included
                clear = not any(bb.overlaps(o) for o in taken) and not any(
                    bb.x0 - pad <= mx <= bb.x1 + pad and bb.y0 - pad <= my <= bb.y1 + pad
                    for mx, my in markers)
                if inside and clear:
                    best = (t, bb)
                    break
                t.remove()
            if best:
                break
        if best is None:  # nothing free: the nearest spot, still readable most of the time
            t = ax.annotate(labels[i], xy[i], xytext=(6, 4), textcoords="offset points",
                            fontsize=7.5, color=colours[i])
            t.update_positions(renderer)
            best = (t, Text.get_window_extent(t, renderer))
        taken.append(best[1])


def _unit(max_bytes: float) -> tuple[float, str]:
    return (2**20, "MiB") if max_bytes >= 2**20 else (2**10, "KiB")


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (and a message) where matplotlib is not
    installed."""
    try:
        import matplotlib
    except ImportError:
        print("bench: matplotlib is not installed; no plot written (pip install matplotlib)",
              file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot(results: dict, path: str) -> bool:
    """Writes the PNG; False (and a message) where matplotlib is not installed.

    One column per network. On top, step time (× plain) against memory kept for backward, and
    against the peak: one point per mode, filled where no other mode is both faster and smaller
    (the front, joined by a staircase: what each step up in time buys). Below, the memory
    timelines of one step, one mode per row, on shared axes."""
    plt = pyplot()
    if plt is None:
        return False
    import matplotlib
    from matplotlib.lines import Line2D

    nets = results["networks"]
    c = results["conditions"]
    mode_rows = [m for m in MODES if any(m in modes for modes in nets.values())]
    n_cols, n_tl = len(nets), len(mode_rows)
    height = 0.9 + 2 * 2.6 + 0.75 + 0.55 * n_tl + 0.45
    fig = plt.figure(figsize=(4.4 * n_cols, height), dpi=110)
    gs = fig.add_gridspec(4 + n_tl, n_cols,
                          height_ratios=[2.6, 0.22, 2.6, 0.75] + [0.55] * n_tl,
                          hspace=0.0, wspace=0.3, top=1 - 0.9 / height, bottom=0.45 / height,
                          left=0.055, right=0.985)
    for col, (net_name, modes) in enumerate(nets.items()):
        ok = {m: r for m, r in modes.items() if r.get("time_vs_plain") is not None}
        sz = sizes_in(c, net_name)
        top = None
        for row, (key, what) in ((0, ("kept_for_backward", "kept for backward")),
                                 (2, ("peak_above_before_forward", "peak"))):
            ax = fig.add_subplot(gs[row, col], sharex=top)
            top = top or ax
            scale, unit = _unit(max([r[key] for r in ok.values()], default=1))
            pts = {m: (r["time_vs_plain"], r[key] / scale) for m, r in ok.items()}
            front = pareto_front(pts)
            xs = [p[0] for p in pts.values()] or [1.0]
            ys = [p[1] for p in pts.values()] or [1.0]
            span = max(max(xs) - min(xs), 0.2)
            ax.set_xlim(min(xs) - 0.3 * span, max(xs) + 0.45 * span)
            ax.set_ylim(0, max(ys) * 1.22 + 1e-9)
            if len(front) > 1:  # the front as a staircase: what each extra bit of time buys
                fx, fy = zip(*(pts[m] for m in front))
                ax.step(fx, fy, where="post", color="black", lw=0.8, alpha=0.45, zorder=1)
            for m, (t, mem) in pts.items():
                on = m in front
                ax.plot(t, mem, "o", ms=7.5 if on else 6, zorder=3,
                        mfc=_COLOURS.get(m, "k") if on else "white",
                        mec=_COLOURS.get(m, "k"), mew=1.5)
            ax.axvline(1.0, color="#bbbbbb", lw=0.7, ls=":", zorder=0)
            ax.grid(alpha=0.25)
            ax.tick_params(labelsize=7.5)
            ax.set_ylabel(f"{what}, {unit}", fontsize=8)
            if row == 0:
                ax.set_title(f"{net_name}  (batch {sz['batch']}, hidden {sz['hidden']}, depth "
                             f"{sz['depth']})", fontsize=10)
                ax.tick_params(labelbottom=False)
                missing = [m for m, r in modes.items() if "error" in r]
                if missing:
                    errs = sorted({modes[m]["error"] for m in missing})
                    ax.text(0.02, 0.97, "n/a: " + ", ".join(missing) + "\n" + "\n".join(
                        e[:70] + ("…" if len(e) > 70 else "") for e in errs),
                        transform=ax.transAxes, va="top", fontsize=6.5, color="#aa0000")
            else:
                ax.set_xlabel(f"step time × plain (median of {c['steps']})", fontsize=8)
            names = list(pts)
            _place_labels(ax, [pts[m] for m in names], names,
                          [_COLOURS.get(m, "k") for m in names])
        # the timelines: one mode per row, shared axes within the network
        first = None
        ymax = max((max(r["timeline"]["bytes_above_before_forward"]) for r in modes.values()
                    if "timeline" in r), default=1)
        scale, unit = _unit(ymax)
        for k, mode in enumerate(mode_rows):
            ax = fig.add_subplot(gs[4 + k, col], sharex=first, sharey=first)
            first = first or ax
            r = modes.get(mode)
            colour = _COLOURS.get(mode, "k")
            if r is not None and "timeline" in r:
                tl = r["timeline"]
                ys = [b / scale for b in tl["bytes_above_before_forward"]]
                ax.fill_between(tl["t_ms"], ys, step="post", color=colour, alpha=0.25, lw=0)
                ax.step(tl["t_ms"], ys, where="post", color=colour, lw=1.0)
                ax.axvline(tl["backward_starts_ms"], color=colour, ls=":", lw=0.8)
                note = f"peak {fmt_bytes(max(tl['bytes_above_before_forward']))}"
            else:
                note = ("not run" if r is None else f"= {r['same_as']}" if "same_as" in r
                        else "n/a (error)" if "error" in r else "")
            ax.text(0.01, 0.9, f"{mode}: {note}", transform=ax.transAxes, ha="left", va="top",
                    fontsize=7, color=colour,
                    bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none", alpha=0.75))
            ax.set_ylim(0, ymax / scale * 1.35 + 1e-9)
            ax.set_yticks([0, ymax / scale])
            ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.3g"))
            ax.tick_params(labelsize=6.5)
            ax.grid(alpha=0.2)
            if k < n_tl - 1:
                ax.tick_params(labelbottom=False)
            else:
                ax.set_xlabel("ms into the instrumented step", fontsize=7.5)
            if k == n_tl // 2:
                ax.set_ylabel(unit, fontsize=7.5)
    fig.text(0.5, 1 - (0.9 + 2 * 2.6 + 0.22 + 0.5) / height,
             "Memory above before-forward through one step, one mode per row, shared axes per "
             "network (dotted: backward starts; the step measured with the counting allocator)",
             ha="center", fontsize=8.5)
    handles = [Line2D([], [], ls="", marker="o", ms=7, mfc="k", mec="k",
                      label="on the front: no other mode is both faster and smaller"),
               Line2D([], [], ls="", marker="o", ms=6, mfc="white", mec="k",
                      label="beaten on both by some other mode"),
               Line2D([], [], color="black", alpha=0.45, lw=0.8, label="the front")]
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.38 / height),
               ncol=3, fontsize=8, frameon=False)
    fig.suptitle(f"Which mode to pick: step time against memory, per network  —  {c['device']}, "
                 f"{c['dtype']}, torch {c['torch']}, preset {c['preset']}", fontsize=10.5,
                 y=1 - 0.12 / height)
    fig.savefig(path)
    plt.close(fig)
    return True

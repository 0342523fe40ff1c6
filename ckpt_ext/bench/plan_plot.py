"""The ``plan`` section's picture (matplotlib, imported only when drawing): step time (× plain)
against the measured peak, one point per configuration measured, the plans joined in budget
order, the budgets as vertical lines. Its raw numbers are the run's JSON beside it."""
from __future__ import annotations

from .plot import pyplot

_STYLE = {"plan": ("#d62728", "o"), "hf": ("#1f77b4", "s"), "compile": ("#7f7f7f", "^"),
          "fuse-all": ("#ff7f0e", "D"), "plain": ("#000000", "o")}


def _kind(name: str) -> str:
    return next((k for k in ("plan", "compile", "fuse-all", "plain") if name.startswith(k)), "hf")


def plot(res: dict, path: str) -> bool:
    """Writes the PNG; False (and a message) where matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        return False

    c, s = res["conditions"], res["sizes"]
    configs = res["configs"]
    fig, ax = plt.subplots(figsize=(8.5, 5.6), dpi=110)
    scale = 2**20
    for b in res["budgets"]:
        ax.axvline(b / scale, color="#bbbbbb", ls="--", lw=0.8, zorder=0)
    seen = set()
    for name, r in configs.items():
        if r.get("time_vs_plain") is None:
            continue
        kind = _kind(name)
        colour, marker = _STYLE[kind]
        label = {"plan": "ckpt_ext.plan", "hf": "transformers, every n-th layer",
                 "compile": "torch.compile, activation_memory_budget",
                 "fuse-all": "ckpt_ext.fuse, every MLP", "plain": "plain"}[kind]
        ax.plot(r["peak"] / scale, r["time_vs_plain"], marker, color=colour, ms=7,
                mfc=colour if kind in ("plan", "plain") else "white", mew=1.5,
                label=None if kind in seen else label, zorder=3)
        seen.add(kind)
        if "fraction" in r:
            ax.annotate(f"{r['fraction']:g}", (r["peak"] / scale, r["time_vs_plain"]),
                        xytext=(4, 4), textcoords="offset points", fontsize=7, color=colour)
    # every n-th layer: one label per peak (n = 4..7 checkpoint the same two layers)
    by_peak: dict = {}
    for r in configs.values():
        if "every_n" in r and r.get("time_vs_plain") is not None:
            by_peak.setdefault(r["peak"], []).append(r)
    for peak, rs in by_peak.items():
        top = max(rs, key=lambda r: r["time_vs_plain"])
        ax.annotate("n=" + ",".join(str(r["every_n"]) for r in rs),
                    (peak / scale, top["time_vs_plain"]), xytext=(4, 4),
                    textcoords="offset points", fontsize=7, color=_STYLE["hf"][0])
    plans = [configs[row["plan"]] for row in res["rows"]]
    ax.plot([r["peak"] / scale for r in plans], [r["time_vs_plain"] for r in plans], "-",
            color=_STYLE["plan"][0], lw=1, alpha=0.6, zorder=2)
    ax.set_xlabel("measured peak above before forward, MiB (dashed: the budgets)")
    ax.set_ylabel(f"step time × plain (median of {s['steps']})")
    ax.grid(alpha=0.25)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3,
              frameon=False)
    ax.set_title(f"Fitting a budget: step time against peak, {s['layers']}-layer Llama "
                 f"(hidden {s['hidden']}, {s['batch']}×{s['seq']} tokens)\n{c['device']}, "
                 f"{c['dtype']}, torch {c['torch']}", fontsize=8.5)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True

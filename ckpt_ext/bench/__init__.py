"""The benchmark: the write-up's experiment with the tools a user would pick instead, side by side
(``python -m ckpt_ext.bench``). Not imported by ``import ckpt_ext``.

presets (sizes, modes, config), measure (timing, floor, max batch), orchestrate (the run),
report (markdown), plot (matplotlib), cli (flags, files), headline (the README's figures); the
``plan`` section: plan_section (the run), plan_report, plan_plot. Method and results:
docs/benchmark.md.
"""
from .presets import DEFAULT_MODES, HEADLINE_MODES, HEADLINE_NETWORKS, MODES, PRESETS

__all__ = ["DEFAULT_MODES", "HEADLINE_MODES", "HEADLINE_NETWORKS", "MODES", "PRESETS"]

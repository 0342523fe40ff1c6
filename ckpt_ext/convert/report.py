"""What ``fuse`` says it did: one :class:`Decision` per run or pair of Linear/activation layers,
gathered in a :class:`FuseReport`; ``fuse`` returns ``Fused(model, report)``."""
from __future__ import annotations

import dataclasses
import enum
import math
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from .fallback import Stats


class Named(str, enum.Enum):
    """A value of a closed set, equal to its text and printed as it."""
    __str__ = str.__str__
    __format__ = str.__format__


class Action(Named):
    FUSED = "fused"
    ALREADY_FUSED = "already fused"
    LEFT_ALONE = "left alone"


class How(Named):
    """Where a unit is computed."""
    SEQUENTIAL = "sequential"  # by the nn.Sequential holding all of it
    ACROSS = "across"          # by one Sequential or forward, across those below holding its layers
    CHILDREN = "children"      # in its owner's forward, whose child modules its layers are
    REWRITE = "rewrite"        # by its owner's forward, rewritten (rewrite=True)
    MODULE = "module"          # by the module's own forward (an experts module)
    NOWHERE = ""               # left alone, or not placed yet


@dataclass(frozen=True, kw_only=True)
class Decision:
    """One run or pair of Linear/activation layers and what fuse did with it. Figures are per *row*
    of the layers' input (every leading dimension counts); a near miss's, what fusing would do."""
    where: str                # module holding the layers ("" = the model itself)
    layers: Tuple[str, ...]   # the layers in call order: paths, or "F.linear" / "torch.tanh" / ...
    action: Action
    unit: str = ""            # what runs them: "tanh_mlp, 3 layers 4->64->64->2", "linear_tanh"
    how: How = How.NOWHERE
    bytes_per_row: int = 0    # activation bytes per row no longer kept, in the parameters' dtypes
    flops_per_row: int = 0    # extra FLOPs per row: the forward GEMMs that backward recomputes
    plain_flops_per_row: int = 0  # these layers' forward + backward GEMM FLOPs per row, unfused
    why: str
    activation: str = ""      # ckpt_ext.ACTIVATIONS' name, "" if not known; mixed: "relu, tanh"
    bytes_per_call: int = 0   # bytes no longer kept per call beyond the rows' (an experts unit's)
    #: (bytes_per_row, bytes_per_call) under torch.autocast of a dtype of that itemsize (0: none)
    count: Optional[Callable[..., Tuple[int, int]]] = field(default=None, repr=False,
                                                           compare=False)

    @property
    def extra_cost(self) -> float:
        """Extra FLOPs as a fraction of these layers' unfused forward + backward."""
        return self.flops_per_row / self.plain_flops_per_row if self.plain_flops_per_row else 0.0


@dataclass
class FuseReport:
    dry_run: bool
    policy: str
    rewrite: bool
    decisions: List[Decision] = field(default_factory=list)
    #: (path, why) for every module with a forward of its own (not torch.nn's) fuse did not analyse
    not_analysed: List[Tuple[str, str]] = field(default_factory=list)
    #: modules whose instance got a rewritten forward (rewrite=True)
    rewritten: List[str] = field(default_factory=list)
    #: (path, why) for every nn.Linear and transformers Conv1D that no decision names
    other_layers: List[Tuple[str, str]] = field(default_factory=list)
    #: (module path, how, units, FLOPs per row) for each module gradient checkpointing recomputes
    checkpointed: List[Tuple[str, str, int, int]] = field(default_factory=list)
    #: the fused units' counts of calls since fuse (ckpt_ext.stats), shown once any call counted
    calls: Stats = field(default_factory=Stats, repr=False, compare=False)
    #: the autocast dtype the figures are for (under_autocast); None: the parameters' dtypes
    autocast: Optional[torch.dtype] = None

    @property
    def fused(self) -> List[Decision]:
        return [d for d in self.decisions if d.action == Action.FUSED]

    @property
    def near_misses(self) -> List[Decision]:
        return [d for d in self.decisions if d.action == Action.LEFT_ALONE]

    @property
    def bytes_per_row(self) -> int:
        return sum(d.bytes_per_row for d in self.fused)

    @property
    def flops_per_row(self) -> int:
        return sum(d.flops_per_row for d in self.fused)

    def under_autocast(self, dtype: torch.dtype) -> "FuseReport":
        """This report with the fused units' bytes those of a step under ``torch.autocast`` of
        ``dtype`` (docs/converter.md, "Dtypes"); a unit counted in no other dtype raises."""
        item = torch.empty((), dtype=dtype).element_size()
        missing = [" -> ".join(d.layers) for d in self.fused if d.count is None]
        if missing:
            raise NotImplementedError(f"under_autocast counts gated MLPs only; not counted: "
                                      f"{'; '.join(missing)}")
        decisions = [dataclasses.replace(d, **dict(zip(("bytes_per_row", "bytes_per_call"),
                                                       d.count(item))))
                     if d.action == Action.FUSED else d for d in self.decisions]
        return dataclasses.replace(self, decisions=decisions, autocast=dtype)

    def __len__(self) -> int:
        return len(self.fused)

    def __str__(self) -> str:
        verb = "would fuse" if self.dry_run else "fused"
        lines = [f"ckpt_ext.fuse(policy={self.policy!r}{', rewrite=True' if self.rewrite else ''}):"
                 f" {verb} {len(self)} unit(s), freeing {self.bytes_per_row:,} B per row for "
                 f"+{self.flops_per_row:,} FLOPs per row"]
        for d in self.decisions:
            layers = " -> ".join(d.layers)
            if d.action == Action.LEFT_ALONE:
                lines.append(f"  left alone  {layers}: {d.why}")
                continue
            tag = verb if d.action == Action.FUSED else Action.ALREADY_FUSED
            lines.append(f"  {tag:<11s} {layers} [{d.how}] as {d.unit}: frees "
                         f"{d.bytes_per_row:,} B/row, +{d.flops_per_row:,} FLOPs/row "
                         f"(+{100 * d.extra_cost:.0f}% of these layers' fwd+bwd); {d.why}")
        lines += [f"  left alone  {path}: {why}" for path, why in self.other_layers]
        if self.rewritten:
            lines.append("  forward rewritten (rewrite=True): "
                         + ", ".join(p or "<model>" for p in self.rewritten))
        lines += [f"  not analysed: {path or '<model>'}: {why}" for path, why in self.not_analysed]
        for path, how, units, flops in self.checkpointed:
            lines.append(f"  recomputed twice: {path or '<model>'} runs under {how}, which "
                         f"recomputes it whole in backward, so its {units} fused unit(s) compute "
                         f"their Linears' forward GEMMs a third time (+{flops:,} FLOPs/row more); "
                         f"with checkpointing off (TrainingArguments(activation_checkpointing="
                         f"False): train() switches it on again otherwise) they keep "
                         f"only their inputs at one recompute: docs/fuse-usage.md, \"Gradient "
                         f"checkpointing\"")
        out = lines[:1] + grouped(lines[1:])
        if self.autocast is not None:
            out.append(f"  bytes under torch.autocast(dtype={self.autocast})")
        elif any(d.count is not None for d in self.fused):
            out.append("  bytes in the parameters' dtypes, without autocast; under it: "
                       "report.under_autocast(torch.bfloat16)")
        if self.calls.fused_calls or self.calls.unfused_calls:
            out.append("  " + str(self.calls).replace("\n", "\n  "))
        return "\n".join(out)


# An index in a module path ("layers.5.mlp"): a number right after a name and a dot.
_INDEX = re.compile(r"(?<=[A-Za-z_]\.)\d+(?=\.|\b)")


def grouped(lines: List[str]) -> List[str]:
    """Lines that differ only in the indices of module paths printed once, where they are every
    combination of the sets the indices take (``layers.{0..31}.fc1 -> layers.{0..31}.fc2``)."""
    groups: Dict[str, List[str]] = {}
    for line in lines:
        groups.setdefault(_INDEX.sub("#", line), []).append(line)
    out: List[str] = []
    for key, group in groups.items():
        rows = sorted({tuple(int(i) for i in _INDEX.findall(line)) for line in group})
        columns = list(zip(*rows)) if rows and rows[0] else []
        distinct = {c for c in columns if len(set(c)) > 1}
        if len(rows) < 2 or math.prod(len(set(c)) for c in distinct) != len(rows):
            out += group
            continue
        shown = [("{" + _spans(sorted(set(c))) + "}") if c in distinct else str(c[0])
                 for c in columns]
        parts = key.split("#")
        out.append(parts[0] + "".join(v + rest for v, rest in zip(shown, parts[1:])))
    return out


def _spans(values: List[int]) -> str:
    """0..31, or 0..3,7,9..12"""
    parts, start = [], values[0]
    for a, b in zip(values, values[1:] + [None]):
        if b != a + 1:
            parts.append(f"{start}..{a}" if a > start else str(start))
            start = b
    return ",".join(parts)


def checkpointed(model: nn.Module, decisions: List[Decision], how) -> List[tuple]:
    """FuseReport.checkpointed: ``how(model, where)`` names the checkpointing of each module on the
    way down to ``where`` that has one, as (path, name)."""
    found: Dict[str, list] = {}
    for d in (d for d in decisions if d.action != Action.LEFT_ALONE and d.unit):
        for path, name in how(model, d.where):
            row = found.setdefault(path, [path, name, 0, 0])
            row[2:] = row[2] + 1, row[3] + d.flops_per_row
    return [tuple(row) for row in found.values()]


class Fused(NamedTuple):
    model: nn.Module
    report: FuseReport



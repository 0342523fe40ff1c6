"""The policy: which stretches of a chain fuse as one unit (``policy="memory"``: a maximal run,
its trailing Tanh and a lone pair only where the consumer does not keep their output anyway;
``policy="all"``: every pair), the near misses, and the report's figures for each (activation
bytes freed and FLOPs added per row)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from torch import nn

from .consumers import Fate
from .report import Decision


class LayerShape(NamedTuple):
    """A Linear of a chain, as the figures of the report need it."""
    label: str
    in_features: int
    out_features: int
    itemsize: int   # bytes per element of its activations


def _gemm(layer: LayerShape) -> int:
    # FLOPs per row of one x·Wᵀ (bias and tanh not counted)
    return 2 * layer.in_features * layer.out_features


def _unit_name(layers: Sequence[LayerShape], last_tanh: bool) -> str:
    sizes = "->".join(str(s) for s in [layers[0].in_features] + [lay.out_features
                                                                  for lay in layers])
    if len(layers) == 1 and last_tanh:
        return f"linear_tanh {sizes}"
    return f"tanh_mlp, {len(layers)} layers {sizes}" + (", last tanh" if last_tanh else "")


@dataclass
class Chain:
    """Calls ``Linear, Tanh, Linear, ...`` in which each value goes only to the next call: the
    candidates the policy makes units of. Item ``2j`` is Linear ``j``, item ``2j + 1`` its Tanh."""
    where: str                    # the module holding its items
    how: str                      # "rewrite", or "" for module calls (the plan says how)
    labels: List[str]             # one per item, in call order
    items: List[Any]              # LayerCall (module calls) or fx nodes (rewrite)
    layers: List[LayerShape]          # one per Linear item
    ends_with_tanh: bool
    fate: Callable[[], Fate]      # what the consumer does with the chain's last output

    def span(self, first: int, last: int, last_tanh: bool) -> Tuple[int, int]:
        """Item indices [start, stop) of layers first..last, with last's Tanh if last_tanh."""
        return 2 * first, 2 * last + (2 if last_tanh else 1)


class Unit(NamedTuple):
    """Layers ``first..last`` of a chain (and the last one's Tanh if ``last_tanh``), fused as one
    op, and the report's decision for them."""
    chain: Chain
    first: int
    last: int
    last_tanh: bool
    decision: Decision


def decide(chain: Chain, policy: str) -> Tuple[List[Unit], List[Decision]]:
    """The units to fuse in a chain and the near misses, with their figures."""
    L = chain.layers
    m = len(L)
    units: List[Unit] = []
    misses: List[Decision] = []

    def figures(a: int, b: int, last_tanh: bool, last_freed: bool) -> Tuple[int, int, int]:
        freed = sum(L[j].out_features * L[j].itemsize for j in range(a, b))
        if last_tanh and last_freed:
            freed += L[b].out_features * L[b].itemsize
        extra = sum(_gemm(L[j]) for j in range(a, b)) + (_gemm(L[b]) if last_tanh else 0)
        plain = sum(3 * _gemm(L[j]) for j in range(a, b + 1))
        return freed, extra, plain

    def labels(a: int, b: int, last_tanh: bool) -> Tuple[str, ...]:
        s, e = chain.span(a, b, last_tanh)
        return tuple(chain.labels[s:e])

    def unit(a: int, b: int, last_tanh: bool, last_freed: bool, why: str) -> None:
        freed, extra, plain = figures(a, b, last_tanh, last_freed)
        d = Decision(chain.where, labels(a, b, last_tanh), "fused",
                     _unit_name(L[a:b + 1], last_tanh), chain.how, freed, extra, plain, why)
        units.append(Unit(chain, a, b, last_tanh, d))

    def miss(a: int, b: int, kept: Optional[bool], why: str, what: str,
             layers: Optional[Tuple[str, ...]] = None) -> None:
        freed, extra, plain = figures(a, b, True, kept is None)
        pot = ("free nothing" if kept else
               f"free {freed:,} B/row only if that consumer does not keep it")
        misses.append(Decision(chain.where, layers or labels(a, b, True), "left alone", "", "",
                               freed if kept is None else 0, extra, plain,
                               f"{what}: {why}; fusing it would {pot} and cost "
                               f"+{extra:,} FLOPs/row"))

    if policy == "all":
        for j in range(m):
            if 2 * j + 1 >= len(chain.items):
                break  # the last Linear, without a Tanh
            if j < m - 1:
                fate = Fate(True, f"kept by {chain.labels[2 * j + 2]} (nn.Linear keeps its "
                                  f"input)")
            else:
                fate = chain.fate()
            note = "" if fate.kept is False else \
                f"; its output is {'kept anyway' if fate.kept else 'maybe kept'}: {fate.why}"
            unit(j, j, True, fate.kept is False, "policy='all' fuses every pair" + note)
        return units, misses

    if m >= 2:
        last_tanh = False
        if chain.ends_with_tanh:
            kept, why = chain.fate()
            if kept is False:
                last_tanh = True
            else:
                miss(m - 1, m - 1, kept, why, "the trailing Tanh is left out of the run "
                     + ("(its output is kept anyway)" if kept else "(its output may be kept)"),
                     (chain.labels[2 * m - 1],))
        inner = m - 1
        why = (f"a run: {inner} inner tanh output(s) are no longer kept, only the run's input"
               + (f"; its last output too ({chain.fate().why})" if last_tanh else ""))
        unit(0, m - 1, last_tanh, True, why)
    elif chain.ends_with_tanh:
        kept, why = chain.fate()
        if kept is False:
            unit(0, 0, True, True, f"a lone pair whose output is not kept: {why}")
        else:
            miss(0, 0, kept, why, "a lone pair whose output is " +
                 ("kept anyway" if kept else "maybe kept"))
    return units, misses


def _pair_labels(labels: List[str], k: int) -> Tuple[str, ...]:
    """The Linear/Tanh pair that item k belongs to (k even: a Linear and its Tanh)."""
    s = k - (k % 2)
    return tuple(labels[s:s + 2])


def item_misses(where: str, labels: List[str], problems: List[Optional[str]],
                 misses: List[Decision]) -> None:
    """One near miss per pair that holds an item with a problem, with all its reasons."""
    groups: Dict[Tuple[str, ...], List[str]] = {}
    for k, p in enumerate(problems):
        if p is not None:
            groups.setdefault(_pair_labels(labels, k), []).append(p)
    for pair, whys in groups.items():
        misses.append(Decision(where, pair, "left alone", "", "", 0, 0, 0,
                               "; ".join(dict.fromkeys(whys))))


def split_at_problems(items_ok: List[Optional[str]], n: int) -> List[Tuple[int, int]]:
    """Maximal item ranges [s, e) without a problem, starting at a Linear (even index)."""
    ranges, s = [], 0
    for i in range(n + 1):
        if i == n or items_ok[i] is not None:
            if s % 2:
                s += 1  # a range must start at a Linear
            if i - s >= 2:
                ranges.append((s, i))
            s = i + 1
    return ranges


def sub_chain(chain: Chain, s: int, e: int, fate: Callable[[], Fate]) -> Chain:
    return Chain(chain.where, chain.how, chain.labels[s:e], chain.items[s:e],
                  chain.layers[s // 2:(e + 1) // 2], (e - s) % 2 == 0, fate)


def layer_shape(label: str, lin: nn.Linear) -> LayerShape:
    return LayerShape(label, lin.in_features, lin.out_features, lin.weight.element_size())


def chain_problem(layers: Sequence[nn.Module]) -> Optional[str]:
    """None when the Linear layers of a run chain (widths) and share one dtype and device."""
    for i, (a, b) in enumerate(zip(layers, layers[1:]), start=1):
        if b.in_features != a.out_features:
            return (f"layer {i}: in_features {b.in_features} does not match the previous "
                    f"Linear's out_features {a.out_features}")
        if b.weight.dtype != a.weight.dtype or b.weight.device != a.weight.device:
            return (f"layer {i}: weight is {b.weight.dtype} on {b.weight.device}, the previous "
                    f"Linear's is {a.weight.dtype} on {a.weight.device}")
    return None

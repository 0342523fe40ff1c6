"""The policy: which stretches of a chain of Linear/activation calls fuse as one unit, the near
misses, and the report's figures per row. Design: docs/converter.md, "Activations"."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from torch import nn

from .. import ops
from ..modules import LayerActivations, collapse_activations
from .facts import DISPLAY, SAVES_INPUT, failing, one_dtype_device
from .values import Fate
from .report import Action, Decision, How


class Policy(str, enum.Enum):
    """``MEMORY``: maximal runs, and what else frees memory; ``ALL``: every lone pair too."""
    MEMORY = "memory"
    ALL = "all"


class LayerShape(NamedTuple):
    label: str
    in_features: int
    out_features: int
    itemsize: int      # bytes per element of its activations
    rank: int = 0      # its LoRA term's (0: none)
    mask: int = 0      # bytes per element of the mask its LoRA dropout draws (0: none)
    trained: bool = True  # its (base) weight requires grad
    cast: int = 0      # bytes per element of its LoRA term's tensors where peft casts the input


def weights(layer: LayerShape) -> int:
    """Elements of its weight and its LoRA term's two."""
    return layer.in_features * layer.out_features + \
        layer.rank * (layer.in_features + layer.out_features)


def gemm(layer: LayerShape) -> int:
    """FLOPs per row of one x·Wᵀ, with its LoRA term's two GEMMs."""
    return 2 * weights(layer)


def plain_gemms(layer: LayerShape) -> int:
    """FLOPs per row of a Linear's forward and backward GEMMs, unfused: the weight's gradient only
    where it is trained; a LoRA term's forward, its input's share and its two gradients."""
    base = 2 * layer.in_features * layer.out_features
    return base * (2 + layer.trained) + 3 * (gemm(layer) - base)


def keeps_input(layer: LayerShape) -> bool:
    """Whether stock autograd keeps the Linear's input: for its weight's gradient, or for its LoRA
    term's lora_A when neither a dropout nor a cast to the adapter's dtype stands between."""
    return layer.trained or (layer.rank > 0 and not layer.mask and not layer.cast)


def lora_bytes(layer: LayerShape) -> int:
    """What stock autograd keeps per row for a LoRA term, in the adapter's dtype (peft casts the
    input to it): lora_B's input (rank wide), and the input lora_A keeps where it is not the
    Linear's own: the dropped input and its dropout's mask, or the input cast."""
    if not layer.rank:
        return 0
    item = layer.cast or layer.itemsize
    taken = layer.in_features * (layer.mask + item) if layer.mask else \
        layer.in_features * layer.cast
    return layer.rank * item + taken


def autocast_shape(layer: LayerShape, item: int) -> LayerShape:
    """The layer under ``torch.autocast`` of an ``item``-byte dtype other than its weight's:
    activations in that dtype, a cast copy of each input it keeps; its dropout mask unchanged."""
    return layer._replace(itemsize=item, cast=item if layer.rank else 0)


def gated_bytes(gate: LayerShape, up: Optional[LayerShape], down: LayerShape, tensors: int,
                masks: int, on_cuda: bool, recomputed: bool, autocast: int = 0) -> Tuple[int, int]:
    """(bytes per row, bytes per call) a fused gated MLP frees: ``tensors`` intermediate-wide
    tensors besides the LoRA terms', ``masks`` Dropout masks, and its input x; ``recomputed``: it
    keeps x itself and no weights; ``autocast``: that dtype's itemsize (0: none). The counts:
    docs/converter.md, "Gated MLPs"."""
    x_item, layers = gate.itemsize, [x for x in (gate, up, down) if x is not None]
    cast = bool(autocast) and autocast != x_item
    if cast:  # the product down reads: kept by down itself, or a LoRA term's cast copy of it
        layers = [autocast_shape(x, autocast) for x in layers]
        tensors += keeps_input(layers[-1]) - keeps_input(down)
        gate, down = layers[0], layers[-1]
    keepers = sum(map(keeps_input, layers[:-1]))
    copies = keepers if cast else min(keepers, 1)  # under autocast each member casts x anew
    kept_x = x_item if recomputed or not cast else autocast
    per_mask = 1 if on_cuda else gate.itemsize
    row = (tensors * gate.itemsize + masks * per_mask) * down.in_features + \
        sum(map(lora_bytes, layers)) + (copies * gate.itemsize - kept_x) * gate.in_features
    call = sum(map(weights, layers)) * autocast if cast and recomputed else 0
    return row, call


def gated_flops(ins: List[LayerShape], down: LayerShape) -> Tuple[int, int]:
    """(extra, plain) FLOPs per row of a gated MLP: the gate and up GEMMs backward recomputes,
    and every member's forward and backward GEMMs unfused."""
    return sum(map(gemm, ins)), sum(map(plain_gemms, ins + [down]))


def lora_note(layers: Sequence[LayerShape]) -> str:
    """", LoRA r=8 on gate, up" for the layers with a LoRA term; "" without."""
    on = [x for x in layers if x.rank]
    if not on:
        return ""
    ranks = sorted({x.rank for x in on})
    return f", LoRA r={'/'.join(map(str, ranks))} on {', '.join(x.label for x in on)}"


def _unit_name(layers: Sequence[LayerShape], activations: Sequence[str], last_act: bool) -> str:
    sizes = "->".join(str(s) for s in [layers[0].in_features] + [x.out_features for x in layers])
    last = f", last {activations[-1]}{lora_note(layers)}" if last_act else lora_note(layers)
    if len(set(activations)) > 1:
        return f"mlp mixed ({', '.join(activations)}), {len(layers)} layers {sizes}{last}"
    form = ops.named_form(activations[0], len(layers), last_act).__name__
    if form == "linear_tanh":
        return f"linear_tanh {sizes}{last[len(', last tanh'):]}"
    name = "tanh_mlp" if form == "tanh_mlp" else f"mlp {activations[0]}"
    s = "s" if len(layers) > 1 or form == "tanh_mlp" else ""
    return f"{name}, {len(layers)} layer{s} {sizes}{last}"


@dataclass
class Chain:
    """Calls ``Linear, Act, ...``, each value going to the next only: item ``2j`` is Linear j."""
    where: str                    # the module holding its items
    how: How                      # REWRITE, CHILDREN, or NOWHERE (placed later)
    labels: List[str]             # one per item, in call order
    items: List[Any]              # LayerCall or fx nodes
    layers: List[LayerShape]      # one per Linear item
    activations: Tuple[Optional[str], ...]
    ends_with_act: bool
    fate: Callable[[], Fate]      # what the consumer does with the chain's last output
    kept: Tuple[int, ...] = ()    # per activation: the tensors stock autograd keeps for it

    def span(self, first: int, last: int, last_act: bool) -> Tuple[int, int]:
        """Item indices [start, stop) of layers first..last, with last's activation if asked."""
        return 2 * first, 2 * last + (2 if last_act else 1)

    def unit_activations(self, first: int, last: int, last_act: bool) -> Tuple[str, ...]:
        return tuple(self.activations[first:last + (1 if last_act else 0)])

    def sub(self, s: int, e: int, fate: Callable[[], Fate]) -> "Chain":
        return Chain(self.where, self.how, self.labels[s:e], self.items[s:e],
                     self.layers[s // 2:(e + 1) // 2], self.activations[s // 2:e // 2],
                     (e - s) % 2 == 0, fate, self.kept[s // 2:e // 2])


class Unit(NamedTuple):
    """Layers ``first..last`` of a chain (with the last's activation if ``last_act``) as one op."""
    chain: Chain
    first: int
    last: int
    last_act: bool
    decision: Decision

    @property
    def activation(self) -> LayerActivations:
        return collapse_activations(self.chain.unit_activations(self.first, self.last,
                                                                self.last_act))

    @property
    def items(self) -> List[Any]:
        return self.chain.items[slice(*self.chain.span(self.first, self.last, self.last_act))]


def decide(chain: Chain, policy: Policy) -> Tuple[List[Unit], List[Decision]]:
    """The units to fuse in a chain and the near misses, with their figures."""
    L, acts, m = chain.layers, chain.activations, len(chain.layers)
    keeps_z = [SAVES_INPUT[a] for a in acts]  # its backward keeps z: fusing frees it anyway
    units, misses = [], []

    def figures(a: int, b: int, last_act: bool, last_freed: bool) -> Tuple[int, int, int]:
        # an inner activation's output is kept by the next Linear only if that keeps its input;
        # the unit's input x is kept by the fused op, and by stock autograd only so
        freed = sum((chain.kept[j] - (keeps_z[j] and not keeps_input(L[j + 1])))
                    * L[j].out_features * L[j].itemsize for j in range(a, b))
        freed += sum(lora_bytes(L[j]) for j in range(a, b + 1))
        freed -= 0 if keeps_input(L[a]) else L[a].in_features * L[a].itemsize
        if last_act:  # what the trailing activation keeps but its output, and that if freed
            kept = chain.kept[b] - 1 + (0 if keeps_z[b] else int(last_freed))
            freed += kept * L[b].out_features * L[b].itemsize
        extra = sum(gemm(L[j]) for j in range(a, b)) + (gemm(L[b]) if last_act else 0)
        return freed, extra, sum(plain_gemms(L[j]) for j in range(a, b + 1))

    def unit(a: int, b: int, last_act: bool, last_freed: bool, why: str) -> None:
        freed, extra, plain = figures(a, b, last_act, last_freed)
        names = chain.unit_activations(a, b, last_act)
        d = Decision(where=chain.where, action=Action.FUSED, how=chain.how,
                     layers=tuple(chain.labels[slice(*chain.span(a, b, last_act))]),
                     unit=_unit_name(L[a:b + 1], names, last_act),
                     bytes_per_row=freed, flops_per_row=extra, plain_flops_per_row=plain, why=why,
                     activation=names[0] if len(set(names)) == 1 else ", ".join(names))
        units.append(Unit(chain, a, b, last_act, d))

    def miss(j: int, kept: Optional[bool], why: str, what: str, layers=None) -> None:
        freed, extra, plain = figures(j, j, True, kept is None)
        pot = "free nothing" if kept else \
            f"free {freed:,} B/row only if that consumer does not keep it"
        layers = layers or tuple(chain.labels[2 * j:2 * j + 2])  # j's Linear and activation
        misses.append(Decision(where=chain.where, layers=layers,
                               action=Action.LEFT_ALONE, bytes_per_row=freed if kept is None else 0,
                               flops_per_row=extra, plain_flops_per_row=plain, activation=acts[j],
                               why=f"{what}: {why}; fusing it would {pot} and cost +{extra:,} "
                                   f"FLOPs/row"))

    def own_input(j: int) -> str:
        return f"{DISPLAY[acts[j]]}'s backward keeps its input, the fused op does not"

    if policy is Policy.ALL:
        last_act = chain.ends_with_act
        if last_act or m >= 2:  # a lone pair: last_act
            kept, why = chain.fate() if last_act else (None, "")
            note = "" if not last_act or kept is False or keeps_z[m - 1] else \
                f"; its output is {'kept anyway' if kept else 'maybe kept'}: {why}"
            unit(0, m - 1, last_act, kept is False, (
                f"policy='all' fuses each run with its trailing activation: {m - 1} inner "
                f"{_inner_kept(acts[:m - 1])} are no longer kept, only the run's input" + note)
                if m >= 2 else "policy='all' fuses every lone pair" +
                (f"; {own_input(0)}" if keeps_z[0] else note))
        return units, misses
    if m >= 2:
        last_act, last_why = False, ""
        if chain.ends_with_act and keeps_z[m - 1]:
            last_act, last_why = True, f"; its last {acts[m - 1]} too ({own_input(m - 1)})"
        elif chain.ends_with_act:
            kept, why = chain.fate()
            if kept is False:
                last_act, last_why = True, f"; its last output too ({why})"
            else:
                miss(m - 1, kept, why, f"the trailing {DISPLAY[acts[m - 1]]} is left out of "
                     f"the run (its output {'is kept anyway' if kept else 'may be kept'})",
                     (chain.labels[2 * m - 1],))
        names = chain.unit_activations(0, m - 1, last_act)
        mixed = f" of mixed activations ({', '.join(names)})" if len(set(names)) > 1 else ""
        unit(0, m - 1, last_act, True, f"a run{mixed}: {m - 1} inner {_inner_kept(acts[:m - 1])} "
             f"are no longer kept, only the run's input" + last_why)
    elif chain.ends_with_act and keeps_z[0]:
        unit(0, 0, True, True, f"a lone pair: {own_input(0)}")
    elif chain.ends_with_act:
        kept, why = chain.fate()
        if kept is False:
            unit(0, 0, True, True, f"a lone pair whose output is not kept: {why}")
        else:
            miss(0, kept, why, "a lone pair whose output is " +
                 ("kept anyway" if kept else "maybe kept"))
    return units, misses


def _inner_kept(inner: Sequence[str]) -> str:
    """What stock autograd keeps of a run's inner activations that the fused op does not."""
    names = list(dict.fromkeys(inner))
    with_z = [a for a in names if SAVES_INPUT[a]]
    if len(with_z) == len(names):
        return f"{', '.join(names)} input(s) and output(s)"
    return f"{', '.join(names)} output(s)" + (f" and {', '.join(with_z)} input(s)" if with_z
                                             else "")


def item_misses(where: str, labels: List[str], problems: List[Optional[str]]) -> List[Decision]:
    """One near miss per Linear/activation pair holding an item with a problem."""
    groups: Dict[Tuple[str, ...], List[str]] = {}
    for k, p in enumerate(problems):
        if p is not None:
            groups.setdefault(tuple(labels[k - k % 2:k - k % 2 + 2]), []).append(p)
    return [Decision(where=where, layers=pair, action=Action.LEFT_ALONE,
                     why="; ".join(dict.fromkeys(whys))) for pair, whys in groups.items()]


def split_at_problems(problems: List[Optional[str]], n: int) -> List[Tuple[int, int]]:
    """Maximal item ranges [s, e) without a problem, starting at a Linear (even index)."""
    ranges, s = [], 0
    for i in range(n + 1):
        if i == n or problems[i] is not None:
            s += s % 2
            if i - s >= 2:
                ranges.append((s, i))
            s = i + 1
    return ranges


def chain_problem(shapes: Sequence[LayerShape], layers: Sequence[nn.Module]) -> Optional[str]:
    """None when the Linear layers of a run chain (widths) and share one dtype and device."""
    for i, (a, b) in enumerate(zip(shapes, shapes[1:]), start=1):
        if b.in_features != a.out_features:
            return (f"layer {i}: in_features {b.in_features} does not match the previous "
                    f"Linear's out_features {a.out_features}")
    return failing([one_dtype_device(tuple(layers), tuple(s.label for s in shapes))])


def mask_bytes(masks: Dict[int, int], layers: Sequence[LayerShape], activations, on_cuda) -> int:
    """What stock autograd keeps per row for ``masks[k]`` Dropouts drawing after item k."""
    total = 0
    for k, n in masks.items():
        layer = layers[k // 2]
        keeps_output = not SAVES_INPUT[activations[k // 2]]
        total += layer.out_features * (n * (1 if on_cuda else layer.itemsize)
                                       + layer.itemsize * keeps_output)
    return total

"""The gated MLP kind: ``down(act(gate(x)) * up(x))`` of one forward's child Linears (or of one
``gate_up`` split by ``chunk``), applied as ``_GatedRun``. Design: docs/converter.md."""
from __future__ import annotations

import ast
import functools
import inspect
import operator
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
from torch import fx, nn

from .. import _dropout_autograd as dropout_unit, ops
from .._recompute import recomputed_modules
from .facts import (DISPLAY, SAVES_INPUT, LayerKind, Recognised, bind, computes, failing,
                    layer_forward, module_tensors, of_class, op_terms,
                    one_dtype_device, stored_weight)
from .fallback import count_fused
from .graph import ModelGraph
from .policy import LayerShape, gated_bytes, gated_flops, keeps_input, lora_note
from .report import Action, Decision, How
from .runtime import _as_layer_would, _through_modules, _trained
from .units import InForward, Options, Placement, RegionKind, _PlaceholderRun, _is_placeholder

_PRODUCTS = {operator.mul, torch.mul, "mul", "mul_"}
_CHUNK = inspect.signature(lambda input, chunks, dim=0: None)
_CHUNKS = (("call_method", "chunk"), ("call_function", torch.chunk))  # chunk(input, 2, dim=-1)


@dataclass(eq=False)
class GatedCall(InForward):
    """One gated MLP of one forward: ``linears`` are gate, up, down (or gate_up, down)."""
    gate: Optional[nn.Linear] = None  # the packed Linear when packed
    up: Optional[nn.Linear] = None
    down: Optional[nn.Linear] = None
    act: Optional[Recognised] = None
    act_module: Optional[nn.Module] = None  # the activation's child module; None for a call
    dropouts: Tuple[fx.Node, ...] = ()
    packed: bool = False
    gate_second: bool = False


def _gated_at(graph, path, owner, t, m, a, b, order) -> Optional[GatedCall]:
    """The gated MLP whose product ``m`` multiplies activation ``a`` by ``b``, else None."""
    nodes = graph.nodes

    def linear(n: Any) -> Optional[nn.Module]:
        sub = nodes[n].child if isinstance(n, fx.Node) else None
        fact = graph.facts.get(id(sub)) if sub is not None else None
        return sub if fact is not None and fact.kind is LayerKind.LINEAR and \
            hasattr(sub, "in_features") else None  # a form it reads in and out features of

    fa = nodes[a]
    if fa.kind is not LayerKind.ACTIVATION or (a.op == "call_module" and fa.child is None) or \
            len(a.users) != 1 or len(b.users) != 1:
        return None
    y = fa.input
    if not isinstance(y, fx.Node) or len(y.users) != 1:
        return None
    packed = gate_second = False
    gate = linear(y)
    if gate is not None:  # two Linears of the same input
        up = linear(b)
        x = nodes[y].only
        if up is None or x is None or nodes[b].only is not x:
            return None
        linears, between = [y, b], []
    else:  # gate, up = gate_up(x).chunk(2, dim=-1)
        if not (y.op == "call_function" and y.target is operator.getitem and
                b.op == "call_function" and b.target is operator.getitem and
                y.args[0] is b.args[0] and {y.args[1], b.args[1]} == {0, 1}):
            return None
        c = y.args[0]
        chunk = bind(c, _CHUNK) if isinstance(c, fx.Node) and (c.op, c.target) in _CHUNKS else None
        p = chunk["input"] if chunk and chunk["chunks"] == 2 and chunk["dim"] == -1 else None
        gate, up = linear(p), None
        if gate is None or set(c.users) != {y, b} or len(p.users) != 1 or nodes[p].only is None:
            return None
        packed, gate_second = True, y.args[1] == 1
        linears, between = [p], [c, y, b]
    cur, dropouts = m, []
    while True:  # through Dropouts to the down projection
        if len(cur.users) != 1:
            return None
        u, = cur.users
        if type(nodes[u].child) is not nn.Dropout or nodes[u].only is not cur:
            break
        dropouts.append(u)
        cur = u
    down = linear(u)
    if down is None or nodes[u].only is not cur:
        return None
    width = down.in_features
    if (up is not None and (up.in_features != gate.in_features or up.out_features != width or
                            gate.out_features != width)) or \
            (up is None and gate.out_features != 2 * width) or width == 0:
        return None
    linears = sorted(linears, key=order.get) + [u]
    labels = tuple(nodes[n].label for n in sorted(linears + [a], key=order.get))
    g = GatedCall(owner, path, t, tuple(linears), tuple(linears + [a, m] + between + dropouts),
                  labels, fa.found.name, tuple(([a] if fa.child is not None else []) + dropouts),
                  gate=gate, up=up, down=down, act=fa.found, act_module=fa.child,
                  dropouts=tuple(dropouts), packed=packed, gate_second=gate_second)
    g.problems = tuple(dict.fromkeys(p for p in _problems(graph, g) if p))
    return g


def _problems(graph: ModelGraph, g: GatedCall):
    yield from graph.members_problems(g.owner, g.trace, g.linears)
    yield g.act.problem
    yield from graph.members_problems(g.owner, g.trace, g.others)  # its activation, Dropouts
    yield failing([one_dtype_device(tuple(graph.nodes[n].child for n in g.linears),
                                    tuple(graph.nodes[n].label for n in g.linears))])
    yield from graph.placeholder_problems(g.path, g.owner, g.trace, g.linears,
                                          lambda stmt: _dtype_cast(stmt, g.linears[-1].target))


def _dtype_cast(stmt: Any, down: str) -> bool:
    """``h = h.to(self.<down>.weight.dtype)``: T5's cast, a no-op where the unit is fused."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and
            isinstance(stmt.targets[0], ast.Name) and isinstance(stmt.value, ast.Call)):
        return False
    call, name = stmt.value, stmt.targets[0].id
    return isinstance(call.func, ast.Attribute) and call.func.attr == "to" and \
        isinstance(call.func.value, ast.Name) and call.func.value.id == name and \
        len(call.args) == 1 and not call.keywords and ast.unparse(call.args[0]) == \
        f"self.{down}.weight.dtype"


class Gated(RegionKind):
    def find(self, graph: ModelGraph, taken: set, options: Options) -> List[GatedCall]:
        found: List[GatedCall] = []
        for path, owner, t in graph.analysed:
            order = {n: i for i, n in enumerate(t.graph.nodes)}
            for m in t.graph.nodes:
                if m.op not in ("call_function", "call_method") or m.target not in _PRODUCTS or \
                        m.kwargs or len(m.args) != 2 or \
                        not all(isinstance(a, fx.Node) for a in m.args):
                    continue
                g = _gated_at(graph, path, owner, t, m, *m.args, order) or \
                    _gated_at(graph, path, owner, t, m, *m.args[::-1], order)
                found += [g] if g else []
        return found

    def decide(self, graph: ModelGraph, g: GatedCall, options: Options):
        labels, facts, name = [graph.nodes[n].label for n in g.linears], graph.facts, g.act.name
        label = {id(graph.nodes[n].child): n.target for n in g.linears}
        gate, up, down = (None if m is None else LayerShape(label[id(m)], *facts[id(m)].width)
                          for m in (g.gate, g.up, g.down))
        ins = [gate] + ([up] if up is not None else [])
        masks = [d for d in (graph.nodes[n].child for n in g.dropouts) if d.p > 0 and d.training]
        weight = stored_weight(graph.nodes[g.linears[0]].child)
        act_tensors = module_tensors(g.act_module, name)
        # per row, as docs/converter.md, "Gated MLPs" derives them
        tensors = act_tensors + 1 + (g.packed and not SAVES_INPUT[name]) + keeps_input(down)
        recomputed = bool(masks) or any(x.rank and (x.mask or x.cast) for x in ins + [down])
        count = functools.partial(gated_bytes, gate, up, down, tensors, len(masks),
                                  weight is not None and weight.device.type == "cuda", recomputed)
        extra, plain = gated_flops(ins, down)
        freed = count()[0]
        if g.problems:
            return [], [Decision(where=g.path, layers=g.labels, action=Action.LEFT_ALONE,
                                 flops_per_row=extra, plain_flops_per_row=plain, activation=name,
                                 why="a gated MLP: " + "; ".join(g.problems))]
        act, second = DISPLAY[name], f"; the activation takes the second half of {labels[0]}"
        unit = (f"gated_mlp {name}, {g.gate.in_features}->2x{down.in_features}->"
                f"{down.out_features}" + (", packed gate_up" if g.packed else "")
                + lora_note(ins + [down]))
        why = (f"a gated MLP, {act}(gate) * up -> down: the {act}'s "
               f"{'input and output' if act_tensors > 1 else 'output'}, the up projection and "
               f"their product are no longer kept, only the input"
               + (second if g.gate_second else "")
               + (f"; {len(masks)} Dropout mask(s) drawn again in backward from the generator's "
                  f"saved state" if masks else "")
               + ("; the LoRA terms' rank-wide and dropout tensors too" if
                  any(x.rank for x in ins + [down]) else ""))
        return [Decision(where=g.path, layers=g.labels, action=Action.FUSED, unit=unit,
                         how=How.CHILDREN, bytes_per_row=freed, flops_per_row=extra,
                         plain_flops_per_row=plain, why=why, activation=name, count=count)], []

    def runtime(self, graph: ModelGraph, p: Placement, decision: Decision) -> _GatedRun:
        return _GatedRun(graph, p, decision)


class _GatedRun(_PlaceholderRun):
    """A gated MLP, ``down(act(gate(x)) * up(x))``, computed by ``gated_mlp``."""

    def __init__(self, graph: ModelGraph, p: Placement, decision: Optional[Decision]) -> None:
        g, self.members = p.found, tuple(s.module for s in p.layer_calls)
        layers = [m for m in (g.gate, g.up, g.down) if m is not None]
        super().__init__(g.labels, self.members, layers, False, (), p.slots,
                         [(m, graph.path[id(m)]) for m in p.unhooked], p.owner, p.calls, (),
                         decision, p.activation)
        self.key = ("gated", self.members, self.activation, bool(g.gate_second))
        self.dropouts = tuple(graph.nodes[n].child for n in g.dropouts)
        self.gate, self.up, self.down, self.act_module = g.gate, g.up, g.down, g.act_module
        self.gate_second = bool(g.gate_second)

    def _own(self):
        if self.act_module is not None:
            yield computes(self.act_module, "its activation module", self.activation)
        for d in self.dropouts:
            yield of_class(d, "a Dropout between the product and the down projection",
                          (nn.Dropout,))

    def _receives(self, index: int, x: Any, carried: Any) -> bool:
        return x is carried if index < len(self.calls) - 1 else _is_placeholder(x, carried)

    _parts = ("computes the gated MLP", "takes part in the gated MLP",
              "returns the gated MLP's output")

    def masks(self) -> Tuple[float, ...]:
        return tuple(d.p for d in self.dropouts if d.p > 0 and d.training)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        count_fused(self)
        gate, up, down = self.gate, self.up, self.down
        terms, masks = [op_terms(m) for m in self.layers], self.masks()
        up_first = up is not None and self.members[0] is up
        loras = [t[2] for t in terms if t is not None]
        # peft draws the LoRA masks in call order, the op gate's first; a packed gate_up's term
        # is one, which the op would split for gate_second
        if _through_modules(terms, bool(masks)) or any(loras) and (
                up_first and any(t is not None and t.dropout > 0 for t in loras) or
                up is None and self.gate_second):
            return recomputed_modules(lambda h: dropout_unit.gated_chain(
                layer_forward(gate), None if up is None else layer_forward(up), layer_forward(down),
                self.activation, self.gate_second, up_first, masks, h), x, _trained(self.layers))
        (w, b, _), (w_up, b_up, _) = terms[0], terms[1] if up is not None else (None, None, None)
        w_down, b_down, _ = terms[-1]
        _as_layer_would(x, self.members[0], w_up if up_first else w)
        if masks:
            return dropout_unit.gated(x, w, w_up, w_down, b, b_up, b_down, self.activation,
                                      self.gate_second, masks)
        if up is None and self.gate_second:  # the activation takes the second half
            (w_up, w), (b_up, b) = w.chunk(2), b.chunk(2) if b is not None else (None, None)
        return ops.gated_mlp(x, w, w_up, w_down, b, b_up, b_down, activation=self.activation,
                             lora=loras if any(t is not None for t in loras) else None)


GATED = Gated()

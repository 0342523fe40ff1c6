"""The inline kind: a run whose forward calls functions between its child Linears, applied as
``_InlineRun``. Design: docs/converter.md, "Function calls inside a run"."""
from __future__ import annotations

import collections
import dataclasses
import inspect
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..modules import collapse_activations
from .facts import (DROPOUT_SIGNATURE, LayerKind, Recognised, bind, computes, module_tensors,
                    of_class, stored_weight)
from .graph import ModelGraph
from .policy import Chain, LayerShape, chain_problem, decide, mask_bytes
from .report import Action, Decision, How
from .units import InForward, Options, Placement, RegionKind, _PlaceholderRun
from .values import Fate


class InlineDrop(NamedTuple):
    """A Dropout after activation ``item // 2``: a child ``module``, or an ``F.dropout`` call with
    its ``p`` and whether it ``draws`` in train() and in eval()."""
    item: int
    label: str
    module: Optional[nn.Module]
    p: float
    draws: Tuple[bool, bool]

    def drawing(self, owner_training: bool) -> bool:
        if self.module is not None:
            return isinstance(self.module, nn.Dropout) and self.module.training and \
                self.module.p > 0
        return self.p > 0 and self.draws[0 if owner_training else 1]


class _InlineRun(_PlaceholderRun):
    """A run with function calls between its Linears; ``acts``: its activation modules'."""

    def __init__(self, graph: ModelGraph, p: Placement, decision: Optional[Decision]) -> None:
        members = [s.module for s in p.layer_calls]
        super().__init__(p.found.labels, members, members, False, (), p.slots,
                         [(m, graph.path[id(m)]) for m in p.unhooked], p.owner, p.calls, (),
                         decision, p.activation)
        self.key = ("inline", tuple(members), self.activation)
        self.acts = tuple((sub, graph.path[id(sub)], f.name)
                          for f, _, sub in p.found.acts if sub is not None)
        self.drops = tuple(p.found.drops)

    def _own(self):
        yield from (computes(m, label, name) for m, label, name in self.acts)
        for d in self.drops:
            if d.module is not None:
                yield of_class(d.module, d.label, (nn.Dropout, nn.Identity))

    def _drawing(self):
        return ((d.item, d.module.p if d.module is not None else d.p)
                for d in self.drops if d.drawing(self.owner.training))


@dataclass(eq=False)
class InlineCall(InForward):
    """A run ``Linear, act, [Dropout ...], Linear, ...`` of child Linears with a function call."""
    # (what it computes, its node, its child module or None) per Linear but the last
    acts: Tuple[Tuple[Recognised, fx.Node, Optional[nn.Module]], ...] = ()
    drops: Tuple[InlineDrop, ...] = ()


def _single_user(n: fx.Node) -> Optional[fx.Node]:
    return next(iter(n.users)) if len(n.users) == 1 else None


_DROPOUT_CALLS = {F.dropout: DROPOUT_SIGNATURE,
                  torch.dropout: inspect.signature(lambda input, p, train: None)}


def _dropout(graph: ModelGraph, n, x: fx.Node, item: int, evals) -> Optional[InlineDrop]:
    """``n`` as a Dropout of the run taking ``x``: a child ``nn.Dropout`` or ``nn.Identity``, or
    ``F.dropout`` / ``torch.dropout`` with a constant p and training (not in place)."""
    if n is None:
        return None
    nf = graph.nodes[n]
    if type(nf.child) in (nn.Dropout, nn.Identity):
        return InlineDrop(item, nf.label, nf.child, getattr(nf.child, "p", 0.0), (True, True)) \
            if nf.only is x else None
    if n.op != "call_function" or n.target not in _DROPOUT_CALLS or n not in evals:
        return None
    args = bind(n, _DROPOUT_CALLS[n.target])
    eval_args = bind(evals[n], _DROPOUT_CALLS[n.target])
    if args is None or eval_args is None:
        return None
    train = "training" if "training" in args else "train"
    p, draws = args.get("p", 0.5), (args.get(train, True), eval_args.get(train, True))
    if args["input"] is not x or args.get("inplace", False) is not False or \
            type(p) not in (int, float) or not 0 <= p <= 1 or {type(d) for d in draws} != {bool}:
        return None
    return InlineDrop(item, "F.dropout", None, float(p), draws)


def _problems(graph: ModelGraph, c: InlineCall):
    owner, t = c.owner, c.trace
    yield from graph.members_problems(owner, t, c.linears)
    for found, n, sub in c.acts:
        yield found.problem
        if sub is not None:
            yield from graph.members_problems(owner, t, [n])
    yield from graph.members_problems(owner, t, [
        n for n in c.nodes if type(graph.nodes[n].child) in (nn.Dropout, nn.Identity)])
    yield chain_problem(_shapes(graph, c), [graph.nodes[n].child for n in c.linears])
    yield from graph.placeholder_problems(c.path, owner, t, c.linears)


def _shapes(graph: ModelGraph, c: InlineCall):
    return [LayerShape(graph.nodes[n].label, *graph.facts[id(graph.nodes[n].child)].width)
            for n in c.linears]


class Inline(RegionKind):
    def find(self, graph: ModelGraph, taken: set, options: Options) -> List[InlineCall]:
        # a forward rewrite=True rewrites is left to the rewrite
        return [call for path, owner, t in graph.analysed
                if not (options.rewrite and t.rewrite_problem is None and not t.already_rewritten)
                for call in self._in(graph, path, owner, t, taken)]

    def _in(self, graph, path, owner, t, taken) -> List[InlineCall]:
        nodes = list(t.graph.nodes)
        evals = dict(zip(nodes, t.eval_graph.nodes))  # the same node in eval()
        facts = graph.nodes

        def linear(n: Optional[fx.Node]) -> bool:
            return n is not None and facts[n].child is not None and \
                facts[n].kind is LayerKind.LINEAR

        found, seen = [], set()
        for n in nodes:
            if n in taken or n in seen or not linear(n):
                continue
            chain, acts, drops, run = [n], [], [], [n]  # chain: its Linears and activations
            cur = n
            while True:
                a = _single_user(cur) or facts[cur].written  # written: as several nodes
                fa = facts[a] if a is not None and a not in taken else None
                if fa is None or fa.kind is not LayerKind.ACTIVATION or fa.input is not cur or \
                        (a.op == "call_module" and fa.child is None):
                    break
                c, between = a, []  # its Dropouts: (node, InlineDrop)
                while (d := _dropout(graph, (u := _single_user(c)), c, 2 * len(acts) + 1,
                                     evals)) is not None:
                    between.append((u, d))
                    c = u
                nxt = _single_user(c)
                if nxt is None or nxt in taken or not linear(nxt) or facts[nxt].only is not c:
                    break
                chain += [a, nxt]
                acts.append((fa.found, a, fa.child))
                drops += [d for _, d in between]
                run += [*fa.inner, a] + [u for u, _ in between] + [nxt]
                cur = nxt
            seen.update(run)
            linears = chain[0::2]
            if len(linears) < 2 or all(x.op == "call_module" for x in run):
                continue
            labels = tuple(facts[x].label for x in chain)
            call = InlineCall(owner, path, t, tuple(linears), tuple(run), labels,
                              collapse_activations([f.name for f, _, _ in acts]), tuple(
                                  n for n in run if n.op == "call_module" and n not in linears),
                              acts=tuple(acts), drops=tuple(drops))
            call.problems = tuple(dict.fromkeys(p for p in _problems(graph, call) if p))
            found.append(call)
        return found

    def decide(self, graph: ModelGraph, c: InlineCall, options: Options):
        """The policy's unit over all its Linears, or left alone with its problems."""
        layers = _shapes(graph, c)
        names = tuple(found.name for found, _, _ in c.acts)
        if c.problems:
            return [], [Decision(where=c.path, layers=c.labels, action=Action.LEFT_ALONE,
                                 why="a run with function calls between its Linears: " +
                                 "; ".join(c.problems), activation=names[0])]
        chain = Chain(c.path, How.CHILDREN, list(c.labels), list(c.nodes), layers, names, False,
                      lambda: Fate(None, ""),
                      tuple(module_tensors(sub, found.name, graph.nodes[n].kept)
                            for found, n, sub in c.acts))
        (unit,), _ = decide(chain, options.policy)
        d = unit.decision
        drawing = [x for x in c.drops if x.drawing(c.owner.training)]
        masks = collections.Counter(x.item for x in drawing)
        on_cuda = stored_weight(graph.nodes[c.linears[0]].child).device.type == "cuda"
        freed = d.bytes_per_row + mask_bytes(masks, layers, names, on_cuda)
        calls = [graph.nodes[n].label for _, n, sub in c.acts if sub is None] + \
            [x.label for x in c.drops if x.module is None]
        why = (f"{d.why}; {', '.join(calls)}, between its Linears, run on a zero-width placeholder"
               + (f"; {len(drawing)} Dropout mask(s) drawn inside the unit and again in backward "
                  f"from the generator's saved state" if drawing else ""))
        return [dataclasses.replace(d, bytes_per_row=freed, why=why)], []

    def runtime(self, graph: ModelGraph, p: Placement, decision: Decision) -> _InlineRun:
        return _InlineRun(graph, p, decision)


INLINE = Inline()

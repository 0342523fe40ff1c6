"""Runs with function calls between their Linears: a forward calling its child Linears with an
activation function or ``F.dropout`` between them (``self.linear2(self.dropout(self.activation(
self.linear1(x))))`` with ``activation=F.relu``, nn.TransformerEncoderLayer's ``_ff_block``;
``fc2(F.dropout(act(fc1(h)), p, training))``, Bart's layers). Found here with what keeps each
from being fused and its report decision; computed in the owner's region by ``_InlineRun``.
Design: docs/converter.md, "Function calls inside a run"."""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import fx, nn

from .activations import Recognised, module_tensors
from .consumers import Fate
from .discovery import (_activation_of, _one_input, activation_problem, child_problem,
                        data_input, members_problems, node_label, placeholder_problems)
from .policy import Chain, chain_problem, decide, layer_shape, mask_bytes
from .report import Decision
from .runtime import InlineDrop, is_conv1d, stored_weight
from .tracing import ModelAnalysis, Trace


@dataclass(eq=False)
class InlineCall:
    """One run ``Linear, act, [Dropout ...], Linear, ...`` of direct child Linears (or Conv1D)
    that a traced method calls with at least one function call among its activations and
    Dropouts; it ends with a Linear."""
    owner: nn.Module
    path: str
    trace: Trace
    linears: Tuple[fx.Node, ...]
    acts: Tuple[Tuple[Recognised, fx.Node, Optional[nn.Module]], ...]  # one per Linear but last
    drops: Tuple[InlineDrop, ...]
    nodes: Tuple[fx.Node, ...]   # every node of the run
    labels: Tuple[str, ...]      # its Linears and activations, in call order
    problems: Tuple[str, ...] = ()

    def child(self, n: fx.Node) -> nn.Module:
        return self.owner._modules[n.target]


def _linear_child(owner: nn.Module, n: Optional[fx.Node]) -> Optional[nn.Module]:
    if n is None or n.op != "call_module" or "." in n.target:
        return None
    sub = owner._modules.get(n.target)
    return sub if isinstance(sub, nn.Linear) or (sub is not None and is_conv1d(sub)) else None


def _single_user(n: fx.Node) -> Optional[fx.Node]:
    return next(iter(n.users)) if len(n.users) == 1 else None


_DROPOUT_CALLS = {F.dropout: inspect.signature(lambda input, p=0.5, training=True,
                                                      inplace=False: None),
                  torch.dropout: inspect.signature(lambda input, p, train: None)}


def _dropout(owner: nn.Module, n: Optional[fx.Node], x: fx.Node, item: int, path: str,
             evals: Dict[fx.Node, fx.Node]) -> Optional[InlineDrop]:
    """``n`` as a Dropout of the run taking ``x``: a child ``nn.Dropout`` or ``nn.Identity``, or
    ``F.dropout`` / ``torch.dropout`` with a constant p and training (not in place)."""
    if n is None:
        return None
    if n.op == "call_module" and "." not in n.target:
        sub = owner._modules.get(n.target)
        if type(sub) in (nn.Dropout, nn.Identity) and _one_input(n) is x:
            return InlineDrop(item, node_label(n, path), sub, getattr(sub, "p", 0.0), (True, True))
        return None
    if n.op != "call_function" or n.target not in _DROPOUT_CALLS:
        return None
    try:
        args = _DROPOUT_CALLS[n.target].bind(*n.args, **n.kwargs).arguments
        eval_args = _DROPOUT_CALLS[n.target].bind(*evals[n].args, **evals[n].kwargs).arguments
    except (TypeError, KeyError):
        return None
    train = "training" if "training" in args else "train"
    p = args.get("p", 0.5)
    if args["input"] is not x or args.get("inplace", False) is not False or \
            type(p) not in (int, float) or not 0 <= p <= 1 or \
            type(args.get(train, True)) is not bool or type(eval_args.get(train, True)) is not bool:
        return None
    return InlineDrop(item, "F.dropout", None, float(p),
                      (args.get(train, True), eval_args.get(train, True)))


def find_inline(analysis: ModelAnalysis, path: str, owner: nn.Module, t: Trace,
                taken: set) -> List[InlineCall]:
    """The runs with function calls between their Linears in one traced method, each with the
    problems that keep it from being fused (none: it is fused). Runs of module calls only are
    the discovery's."""
    nodes = list(t.graph.nodes)
    evals = dict(zip(nodes, t.eval_graph.nodes)) if t.eval_graph is not None else \
        {n: n for n in nodes}
    found, seen = [], set()
    for n in nodes:
        if n in taken or n in seen or _linear_child(owner, n) is None:
            continue
        linears, acts, drops, run = [n], [], [], [n]
        cur = n
        while True:
            a = _single_user(cur)
            act = _activation_of(owner, a) if a is not None and a not in taken else None
            if act is None or data_input(a) is not cur:
                break
            c, between, ds = a, [], []
            while True:
                u = _single_user(c)
                d = _dropout(owner, u, c, 2 * len(acts) + 1, path, evals)
                if d is None:
                    break
                ds.append(d)
                between.append(u)
                c = u
            nxt = _single_user(c)
            if nxt is None or nxt in taken or _linear_child(owner, nxt) is None or \
                    _one_input(nxt) is not c:
                break
            linears.append(nxt)
            acts.append((act[0], a, act[1]))
            drops += ds
            run += [a] + between + [nxt]
            cur = nxt
        seen.update(run)
        if len(linears) < 2 or all(x.op == "call_module" for x in run):
            continue
        labels = []
        for k, lin in enumerate(linears):
            labels.append(node_label(lin, path))
            if k < len(acts):
                labels.append(node_label(acts[k][1], path))
        call = InlineCall(owner, path, t, tuple(linears), tuple(acts), tuple(drops), tuple(run),
                          tuple(labels))
        call.problems = tuple(dict.fromkeys(p for p in _problems(analysis, call) if p))
        found.append(call)
    return found


def _problems(analysis: ModelAnalysis, c: InlineCall):
    owner, t = c.owner, c.trace
    yield from members_problems(analysis, owner, c.path, t, c.linears)
    for found, n, sub in c.acts:
        yield found.problem
        if sub is not None:
            yield activation_problem(sub)
            yield child_problem(analysis, owner, t, n.target, node_label(n, c.path), sub)
    for n in c.nodes:
        if n.op == "call_module" and type(c.child(n)) in (nn.Dropout, nn.Identity):
            yield child_problem(analysis, owner, t, n.target, node_label(n, c.path), c.child(n))
    layers = [c.child(n) for n in c.linears]
    if any(stored_weight(lin) is None for lin in layers):
        yield "a weight is not made yet (a lazy layer)"
    else:
        yield chain_problem(layers)
    yield from placeholder_problems(c.path, owner, t, c.linears)


def inline_decision(c: InlineCall, policy: str) -> Decision:
    """The report's decision for an inline run: the policy's unit over all its Linears (with
    the masks of the Dropouts drawing now counted), or left alone with its problems."""
    layers = [layer_shape(node_label(n, c.path), c.child(n)) for n in c.linears]
    names = tuple(found.name for found, _, _ in c.acts)
    chain = Chain(c.path, "children", list(c.labels), list(c.nodes), layers, names, False,
                  lambda: Fate(None, ""), {},
                  tuple(module_tensors(sub, found.name) for found, _, sub in c.acts))
    if c.problems:
        return Decision(c.path, c.labels, "left alone", "", "", 0, 0, 0,
                        "a run with function calls between its Linears: " +
                        "; ".join(c.problems), activation=names[0])
    (unit,), _ = decide(chain, policy)
    d = unit.decision
    drawing = [x for x in c.drops if x.drawing(c.owner.training)]
    masks: Dict[int, int] = {}
    for x in drawing:
        masks[x.item] = masks.get(x.item, 0) + 1
    on_cuda = stored_weight(c.child(c.linears[0])).device.type == "cuda"
    freed = d.bytes_per_row + mask_bytes(masks, layers, names, on_cuda)
    calls = [node_label(n, c.path) for _, n, sub in c.acts if sub is None] + \
        [x.label for x in c.drops if x.module is None]
    why = (f"{d.why}; {', '.join(calls)}, between its Linears, "
           f"run on a zero-width placeholder" +
           (f"; {len(drawing)} Dropout mask(s) drawn inside the unit and again in backward from "
            f"the generator's saved state" if drawing else ""))
    return dataclasses.replace(d, bytes_per_row=freed, why=why)


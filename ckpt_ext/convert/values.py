"""Where a value of the model goes, across module boundaries (:class:`ValueUsers`), and what its
consumers do with it (:class:`ValueFates`): the views of :class:`~.graph.ModelGraph` that follow a
value, on the module tree and traces it holds (``facts``, ``trace``, ``path``, ``caller``, ...)."""
from __future__ import annotations

import operator
from typing import Any, Callable, List, NamedTuple, Optional, Tuple

from torch import fx, nn

from .facts import (DROPOUT_FUNCTIONS, DROPOUT_SIGNATURE, FREEING_FUNCTIONS, FREEING_METHODS,
                    FREEING_MODULES, KEEPING_FUNCTIONS, KEEPING_METHODS, KEEPING_MODULES,
                    META_FUNCTIONS, META_METHODS, PASS_THROUGH_MODULES, SAVES_INPUT,
                    SCALING_FUNCTIONS, SCALING_METHODS, VIEW_FUNCTIONS, VIEW_METHODS, LayerKind,
                    bind, join_path)
from .tracing import after_branch


class Fate(NamedTuple):
    """What the consumers of a value do with it."""
    kept: Optional[bool]  # True: kept for backward by a consumer, False: not kept, None: unknown
    why: str


class Crossing(NamedTuple):
    """A module a value enters or leaves (``out``), which ``caller`` calls ``target``; ``strict``:
    entered as a call's one argument (its forward's arity), or left for an analysed caller."""
    module: nn.Module
    out: bool
    caller: nn.Module
    target: str
    calls: int
    strict: bool
    position: int = 0      # entered as this argument
    by_place: bool = True  # left to where its (first) place's caller sends it


class Use(NamedTuple):
    """A consumer of a value: ``at``, an element of the Sequential ``owner`` or a node of its
    forward, calling ``module``; ``owner`` None: the model returns it, or (``why``) unknown."""
    owner: Optional[nn.Module] = None
    at: Any = None
    module: Optional[nn.Module] = None
    value: Any = None
    crossed: Tuple[Crossing, ...] = ()
    why: str = ""


#: modules whose effect on a value the op tables give: the walk does not go into their forward
_TABLED = PASS_THROUGH_MODULES + (nn.modules.dropout._DropoutNd,) + FREEING_MODULES + \
    KEEPING_MODULES


class ValueUsers:
    """The one walker of values across module boundaries: into the forwards and Sequentials a value
    enters, and out to their callers."""

    def users(self, owner: nn.Module, at: Any, crossed=(), entered=(), depth=0) -> List[Use]:
        """The consumers of the value at ``at`` of ``owner`` (a node, or a Sequential's element),
        into and out of the modules it goes through (back by the calls ``entered``)."""
        if depth > 64:
            return [Use(value=at, crossed=crossed, why="the chain of users is too deep to follow")]
        if self.facts[id(owner)].sequential:
            if at + 1 < len(owner._modules):
                return self._element(owner, at + 1, crossed, entered, depth)
            return self._out_of(owner, crossed, entered, depth)
        out: List[Use] = []
        for u in at.users:
            if u.op == "output" and u.args[0] is at and self.trace[id(owner)].method == "forward":
                out += self._out_of(owner, crossed, entered, depth)
            elif u.op == "call_module":
                out += self._into(owner, at, u, crossed, entered, depth)
            else:
                out.append(Use(owner, u, None, at, crossed))
        return out

    def _element(self, seq: nn.Module, i: int, crossed, entered, depth) -> List[Use]:
        name, e = list(seq._modules.items())[i]
        if self.facts[id(e)].sequential and e._modules:
            return self._element(e, 0, crossed + (Crossing(e, False, seq, name, 1, True),),
                                 entered + ((seq, i),), depth + 1)
        return [Use(seq, i, e, None, crossed)]

    def _into(self, owner: nn.Module, node: fx.Node, u: fx.Node, crossed, entered, depth):
        sub = owner.get_submodule(u.target)
        ks = [k for k, a in enumerate(u.args) if a is node]
        if len(ks) == 1 and not any(v is node for v in u.kwargs.values()):
            k, fact, t = ks[0], self.facts[id(sub)], self.trace.get(id(sub))
            n = len(self.calls_of(owner, u.target))
            if fact.sequential and sub._modules and k == 0:
                c = Crossing(sub, False, owner, u.target, n, len(u.args) == 1 and not u.kwargs)
                return self._element(sub, 0, crossed + (c,), entered + ((owner, u),), depth + 1)
            if t is not None and t.method == "forward" and fact.kind is None and \
                    not isinstance(sub, _TABLED):
                ph = [p for p in t.graph.nodes if p.op == "placeholder"]
                if k < len(ph):
                    strict = not u.kwargs and len(ph) == len(u.args) and not t.already_rewritten
                    c = Crossing(sub, False, owner, u.target, n, strict, k)
                    return self.users(sub, ph[k], crossed + (c,), entered + ((owner, u),),
                                      depth + 1)
        return [Use(owner, u, sub, node, crossed)]

    def _out_of(self, m: nn.Module, crossed, entered, depth) -> List[Use]:
        if entered:  # back to the call it came in by
            caller, at = entered[-1]
            target = at.target if isinstance(at, fx.Node) else list(caller._modules)[at]
            c = Crossing(m, True, caller, target, 1, True, by_place=False)
            return self.users(caller, at, crossed + (c,), entered[:-1], depth + 1)
        site = self.returned(m, crossed)
        return site if isinstance(site, list) else self.users(*site, (), depth + 1)

    def returned(self, m: nn.Module, crossed: Tuple[Crossing, ...] = ()):
        """(caller, the call of ``m`` there, the crossings), or [a Use] where nothing is known."""
        caller = self.caller.get(id(m))
        if m is self.model or caller is None:
            return [Use(crossed=crossed)]
        parent, ppath, target = caller
        if self.facts[id(parent)].sequential and "." not in target:
            return parent, list(parent._modules).index(target), \
                crossed + (Crossing(m, True, parent, target, 1, True),)
        t, where = self.traces.get(id(parent)), ppath or "<model>"
        if t is None or not t.ok:
            why = f" ({t.reason})" if t is not None else ""
            return [Use(crossed=crossed + (Crossing(m, True, parent, target, 1, False),),
                        why=f"its caller {where} was not analysed{why}")]
        calls = self.calls_of(parent, target)
        crossed += (Crossing(m, True, parent, target, len(calls), True),)
        if not calls:
            return [Use(crossed=crossed, why=(
                f"{where}.{t.method} calls {target} after it branches on a traced value (line "
                f"{t.cut_line}), which fx cannot follow" if t.cut_line is not None
                else f"{where}.forward calls {target} 0 times"))]
        return parent, calls[0], crossed


class ValueFates(ValueUsers):
    """What the consumers of a value do with it: keep it for backward, free it, or unknown (why)."""

    def fate(self, owner: nn.Module, at: Any, depth: int = 0) -> Fate:
        """What the consumers of the value at ``at`` of ``owner`` (see :meth:`users`) do."""
        return _combine([self._use_fate(u, depth + 1)
                         for u in self.users(owner, at, (), (), depth)])

    def _use_fate(self, u: Use, depth: int) -> Fate:
        for c in u.crossed:
            if c.out and c.by_place:
                places = self.paths.get(id(c.module), [])
                if len(places) != 1:
                    return Fate(None, f"{places[0] if places else 'a module'} sits at "
                                      f"{len(places)} places")
                if c.calls > 1:
                    return Fate(None, f"{self.path[id(c.caller)] or '<model>'}.forward calls "
                                      f"{c.target} {c.calls} times")
            if not c.out and c.position:
                return Fate(None, f"passed to {join_path(self.path[id(c.caller)], c.target)} "
                                  f"other than as its only input")
        if u.why:
            return Fate(None, u.why)
        if u.owner is None:
            return Fate(False, "returned by the model (freed unless the loss keeps it: "
                               ".mean()/.sum() do not, mse_loss does)")
        if u.module is not None:
            return self._module_fate(u, depth)
        node, value, owner = u.at, u.value, u.owner
        t, opath = self.trace[id(owner)], self.path[id(owner)] or "<model>"
        if node.op == "output":
            if t.method != "forward":
                return Fate(None, f"{opath}.{t.method} returns it to callers fuse did not "
                                  f"analyse")
            out = node.args[0]
            where = [i for i, o in enumerate(out) if o is value] \
                if isinstance(out, (tuple, list)) else []
            if len(where) != 1:
                return Fate(None, f"{opath} returns it inside a nested structure")
            return self._element_fate(owner, where[0], depth)
        if node.op not in ("call_function", "call_method"):
            return Fate(None, f"used by a {node.op} node")
        target, is_fn = node.target, node.op == "call_function"
        name = _fn_name(target)
        on_output = (lambda: self.fate(owner, node, depth + 1))

        def among(functions: set, methods: set) -> bool:
            return target in (functions if is_fn else methods)

        if is_fn and target is after_branch:
            return Fate(None, f"used after {opath}.{t.method} branches on a traced value (line "
                              f"{t.cut_line}), which fx cannot follow")
        if is_fn and target in DROPOUT_FUNCTIONS:
            args = bind(node, DROPOUT_SIGNATURE)
            if args is None:
                return Fate(None, f"used by {name} with arguments fuse cannot read")
            p, training = args["p"], args["training"]
            if args["input"] is not value or any(isinstance(a, fx.Node) for a in (p, training)):
                return Fate(None, f"used by {name} with a p or training fuse cannot read")
            return _dropout_fate(f"{name}(p={p})", p, training, on_output)
        if among(META_FUNCTIONS, META_METHODS):
            return Fate(False, "")
        if among(VIEW_FUNCTIONS, VIEW_METHODS):
            return on_output()
        if among(FREEING_FUNCTIONS, FREEING_METHODS):
            what = " (a residual add)" if target in (operator.add, operator.iadd, "add") else ""
            return Fate(False, f"its user {name}{what} does not keep it")
        if among(SCALING_FUNCTIONS, SCALING_METHODS):
            if any(isinstance(a, fx.Node) and a is not value for a in node.args):
                return Fate(True, f"kept by {name} with another tensor")
            return Fate(False, f"its user {name} by a constant does not keep it")
        if among(KEEPING_FUNCTIONS, KEEPING_METHODS):
            return Fate(True, f"kept by {name}")
        return Fate(None, f"used by {name}, not known to keep or free its input")

    def _element_fate(self, m: nn.Module, index: int, depth: int) -> Fate:
        """What the callers of ``m`` do with element ``index`` of the tuple it returns."""
        site = self.returned(m)
        if isinstance(site, list):
            return self._use_fate(site[0], depth)
        parent, call, crossed = site
        bad = self._use_fate(Use(crossed=crossed, why="-"), depth)
        if bad.why != "-":
            return bad
        if self.facts[id(parent)].sequential:
            return Fate(None, f"{self.path[id(m)]} returns a tuple inside an nn.Sequential")
        fates = []
        for g in call.users:
            if g.op == "call_function" and g.target is operator.getitem and \
                    g.args[0] is call and not isinstance(g.args[1], fx.Node):
                if g.args[1] == index:
                    fates.append(self.fate(parent, g, depth + 1))
            else:
                fates.append(Fate(None, f"output {index} is used as part of a whole"))
        return _combine(fates)

    def _module_fate(self, u: Use, depth: int) -> Fate:
        sub, owner, at = u.module, u.owner, u.at
        if isinstance(at, fx.Node):
            label = self.nodes[at].label
            others = list(at.args[1:]) + list(at.kwargs.values())
            if not at.args or at.args[0] is not u.value or any(a is u.value for a in others):
                return Fate(None, f"passed to {label} other than as its only input")
        else:
            label = join_path(self.path[id(owner)], list(owner._modules)[at])
        fact = self.facts[id(sub)]
        on_output = (lambda: self.fate(owner, at, depth + 1))
        if isinstance(sub, PASS_THROUGH_MODULES) or fact.sequential:  # an empty Sequential too
            return on_output()
        if isinstance(sub, nn.modules.dropout._DropoutNd):
            return _dropout_fate(f"{label} ({type(sub).__name__}(p={sub.p}))", sub.p,
                                 sub.training, on_output)
        if isinstance(sub, FREEING_MODULES):
            return Fate(False, f"its user {label} ({type(sub).__name__}) does not keep it")
        if isinstance(sub, KEEPING_MODULES) or fact.kind is LayerKind.LINEAR:
            return Fate(True, f"kept by {label} ({type(sub).__name__} keeps its input)")
        found = fact.found
        if found is not None and found.name is not None:  # transformers' activation modules
            if SAVES_INPUT[found.name]:
                return Fate(True, f"kept by {label} ({type(sub).__name__} keeps its input)")
            return Fate(False, f"its user {label} ({type(sub).__name__}) does not keep it")
        return Fate(None, f"its user {label} ({type(sub).__name__}) is not known to keep or "
                          f"free it")


def _fn_name(target: Any) -> str:
    if isinstance(target, str):
        return f".{target}()"
    mod = getattr(target, "__module__", "") or ""
    name = getattr(target, "__name__", repr(target))
    if mod.startswith("torch.nn.functional"):
        return f"F.{name}"
    if mod.startswith("torch") or mod == "_operator":
        return ("operator." if mod == "_operator" else "torch.") + name
    return name


def _combine(fates: List[Fate]) -> Fate:
    """Kept if any consumer keeps it, else unknown if any consumer is unknown, else not kept."""
    for kept in (True, None):
        for f in fates:
            if f.kept is kept:
                return f
    whys = [f.why for f in fates if f.why]
    return Fate(False, "; ".join(dict.fromkeys(whys)) or "nothing uses it")


def _dropout_fate(label: str, p: float, training: bool, on_output: Callable[[], Fate]) -> Fate:
    """Dropout keeps only its mask; with p = 0, or in eval(), what its output's consumers keep."""
    if p == 0 or training is False:
        kept, why = on_output()
        return Fate(kept, f"{why} (through {label}, which returns its input "
                          f"{'with p=0' if p == 0 else 'in eval()'})")
    return Fate(False, f"its user {label} keeps only its mask (in train(); in eval() it passes "
                       f"the value on)")

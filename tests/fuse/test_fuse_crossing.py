"""ckpt_ext.fuse on runs that cross the forwards of child modules (out of one's output, into
another's positional argument) and on a method a forward hands to a helper: each fused model
computes what an unfused deep copy computes (float64: outputs and every gradient), keeps what the
report says it frees less, and computes layer by layer wherever its analysis cannot vouch for the
path (a hook, a changed attribute, a module held twice)."""
from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch
from torch import nn

from ckpt_ext import fuse
from ckpt_ext.convert import RunLinear
from ckpt_ext.convert.runtime import _OwnerForward
from _ecosys import kept_bytes, outputs_and_grads, rel_err, saved_activation_bytes

F64 = torch.float64
TOL = 2e-15  # as test_fuse_activations: measured within 3.6e-16, relative


def assert_same(before, after, *inputs):
    out_b, in_b, g_b = outputs_and_grads(before, *inputs)
    out_a, in_a, g_a = outputs_and_grads(after, *inputs)
    for a, b in zip(out_a + in_a, out_b + in_b):
        assert rel_err(a, b) <= TOL
    assert g_a.keys() == g_b.keys() and len(g_b) > 0
    for name in g_b:
        assert rel_err(g_a[name], g_b[name]) <= TOL, name


def freed(before, after, x):
    """Bytes plain autograd keeps that the fused model does not, by both meters (they agree)."""
    saved = saved_activation_bytes(before, x) - saved_activation_bytes(after, x)
    assert kept_bytes(before, x) - kept_bytes(after, x) == saved
    return saved


class Block(nn.Module):
    """fc then a GELU; ``double`` is an attribute its forward branches on (False when fused)."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.fc, self.act = nn.Linear(d_in, d_out), nn.GELU()
        self.double = False

    def forward(self, x):
        h = self.fc(x)
        if self.double:
            h = h * 2
        return self.act(h)


class Head(nn.Module):
    """fc of its first argument, plus its second: BertOutput's shape."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)

    def forward(self, h, skip):
        return self.fc(h) + skip


class Stack(nn.Module):
    """b1, b2 (Blocks) then head: one run b1.fc, b1.act, b2.fc, b2.act, head.fc through three
    forwards."""

    def __init__(self):
        super().__init__()
        self.b1, self.b2, self.head = Block(6, 16), Block(16, 12), Head(12, 6)

    def forward(self, x):
        return self.head(self.b2(self.b1(x)), x)


RUN = ("b1.fc", "b1.act", "b2.fc", "b2.act", "head.fc")


def _stack():
    torch.manual_seed(0)
    model = Stack().double()
    return model, copy.deepcopy(model)


def test_a_run_crosses_child_forwards():
    model, plain = _stack()
    _, report = fuse(model)
    assert [(d.layers, d.how, d.activation) for d in report.fused] == [(RUN, "across", "gelu")]
    d = report.fused[0]
    assert "it crosses b1, b2, head in <model>: inside <model>.forward, b1.fc computes" in d.why
    assert d.bytes_per_row == 2 * (16 + 12) * 8  # z and act(z) of both inner layers
    assert [type(m) for m in model.children()] == [Block, Block, Head]
    assert type(model.head.fc) is RunLinear and "forward" not in vars(model.b1)
    x = torch.randn(5, 6, dtype=F64)
    assert_same(plain, model, x)
    assert freed(plain, model, x) == 5 * d.bytes_per_row
    _, again = fuse(model)  # in place already: kept as it is
    assert [d.action for d in again.decisions] == ["already fused"]


def test_each_crossed_module_alone_computes_its_own_layers():
    model, plain = _stack()
    fuse(model)
    x = torch.randn(4, 6, dtype=F64)
    assert_same(plain.b1, model.b1, x)
    h = torch.randn(4, 12, dtype=F64)
    out_b, out_f = plain.head(h, x), model.head(h, x)
    assert torch.equal(out_b, out_f)


def test_a_changed_attribute_of_a_crossed_forward_computes_layer_by_layer():
    """b2.double is a guard of the owner: switched on after fusing, the forward takes the branch
    fx did not see, unfused, and computes what the unfused copy computes with the same switch."""
    model, plain = _stack()
    fuse(model)
    guards = vars(model)["forward"].guards
    assert any(g.path == "b2" and g.name == "double" for g in guards)
    model.b2.double = plain.b2.double = True
    x = torch.randn(3, 6, dtype=F64)
    assert_same(plain, model, x)
    assert saved_activation_bytes(model, x) == saved_activation_bytes(plain, x)


def test_a_hook_on_a_crossed_module_computes_layer_by_layer():
    model, plain = _stack()
    fuse(model)
    seen = []
    handle = model.b1.register_forward_hook(lambda m, args, out: seen.append(out.shape[-1]))
    x = torch.randn(3, 6, dtype=F64)
    assert_same(plain, model, x)
    assert seen and set(seen) == {16}  # b1's own output, every call
    handle.remove()
    assert freed(plain, model, x) == 3 * 2 * (16 + 12) * 8


class Twice(nn.Module):
    """The same Block held at two places: a run may not cross it."""

    def __init__(self):
        super().__init__()
        self.b1 = Block(6, 8)
        self.alias = self.b1
        self.head = Head(8, 6)

    def forward(self, x):
        return self.head(self.b1(x), x)


def test_a_module_held_twice_is_not_crossed():
    torch.manual_seed(0)
    model = Twice().double()
    plain = copy.deepcopy(model)
    _, report = fuse(model)
    assert all(d.layers != ("b1.fc", "b1.act", "head.fc") for d in report.decisions)
    assert any("b1 is held at 2 places" in d.why for d in report.decisions)
    assert_same(plain, model, torch.randn(3, 6, dtype=F64))


def chunked(fn, x):
    """A helper that calls a bound method on each half of the rows, as transformers'
    apply_chunking_to_forward does (it also checks the method's arity)."""
    assert len(inspect.signature(fn).parameters) == 1
    return torch.cat([fn(c) for c in x.chunk(2)], 0)


class Layer(nn.Module):
    """A forward fx cannot follow (an optional argument) that hands the method holding the MLP to
    a helper."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(6)
        self.inp, self.act, self.out = nn.Linear(6, 20), nn.SiLU(), nn.Linear(20, 6)

    def forward(self, x, scale=None):
        x = self.norm(x)
        return chunked(self.mlp, x) * (1.0 if scale is None else scale)

    def mlp(self, x):
        return self.out(self.act(self.inp(x)))


def test_a_method_handed_to_a_helper_marks_the_region():
    torch.manual_seed(0)
    model = nn.Sequential(Layer(), Layer()).double()
    plain = copy.deepcopy(model)
    _, report = fuse(model)
    runs = [(f"{i}.inp", f"{i}.act", f"{i}.out") for i in range(2)]
    assert [(d.layers, d.how) for d in report.fused] == [(r, "children") for r in runs]
    assert dict(report.not_analysed)["0"].endswith(
        "fuse analysed the method its forward names, mlp, in its place")
    for layer in model:
        wrapper = vars(layer)["mlp"]
        assert isinstance(wrapper, _OwnerForward) and wrapper.method == "mlp"
        assert list(inspect.signature(layer.mlp).parameters) == ["x"]
        assert type(layer) is Layer and "forward" not in vars(layer)
    x = torch.randn(6, 6, dtype=F64)
    assert_same(plain, model, x)
    assert freed(plain, model, x) == 6 * report.bytes_per_row == 6 * 2 * 2 * 20 * 8
    for m in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert vars(m[0])["mlp"].owner is m[0]
        assert_same(plain, m, x)


class TwoMethods(Layer):
    """A forward that names two methods calling children: which one runs is not known."""

    def forward(self, x, scale=None):
        return chunked(self.mlp if scale is None else self.other, x)

    def other(self, x):
        return self.inp(x)


def test_a_forward_naming_two_such_methods_is_left_alone():
    torch.manual_seed(0)
    model = TwoMethods().double()
    _, report = fuse(model)
    assert len(report) == 0 and "mlp" not in vars(model)
    assert "" in dict(report.not_analysed)  # with the reason its forward was not analysed


def test_the_crossing_run_compiles_to_one_op():
    model, plain = _stack()
    fuse(model)
    ops = []

    def backend(gm, inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(4, 6, dtype=F64)
    assert rel_err(compiled(x), plain(x)) <= TOL
    assert ops.count("ckpt_ext.mlp.default") == 1 and "aten.linear.default" not in ops


class Body(nn.Module):
    """Its forward calls a Sequential (Linear, SiLU)."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.seq = nn.Sequential(nn.Linear(d_in, d_out), nn.SiLU())

    def forward(self, x):
        return self.seq(x)


class Encoder(nn.Module):
    """Crossed forwards nested two deep: enc -> body -> seq."""

    def __init__(self):
        super().__init__()
        self.body = Body(5, 9)

    def forward(self, x):
        return self.body(x)


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.mid, self.head = Encoder(), Body(9, 7), Head(7, 5)

    def forward(self, x):
        return self.head(self.mid(self.enc(x)), x)


def test_a_run_crosses_nested_forwards_and_their_sequentials():
    """The run enc.body.seq.0 .. head.fc crosses enc, enc.body, mid and head: its members are the
    two Sequentials (the first computes the run, the second passes it on) and head.fc."""
    torch.manual_seed(0)
    model = Nested().double()
    plain = copy.deepcopy(model)
    _, report = fuse(model)
    run = ("enc.body.seq.0", "enc.body.seq.1", "mid.seq.0", "mid.seq.1", "head.fc")
    assert [(d.layers, d.how, d.activation) for d in report.fused] == [(run, "across", "silu")]
    x = torch.randn(4, 5, dtype=F64)
    assert_same(plain, model, x)
    assert freed(plain, model, x) == 4 * report.bytes_per_row == 4 * 2 * (9 + 7) * 8
    assert torch.equal(model.mid(torch.ones(2, 9, dtype=F64)), plain.mid(torch.ones(2, 9, dtype=F64)))
    fuse(model, trace=False)  # without the analysis: every region and member is undone
    assert "forward" not in vars(model) and type(model.head.fc) is nn.Linear
    assert_same(plain, model, x)


def test_without_the_analysis_a_method_region_is_undone():
    torch.manual_seed(0)
    model = Layer().double()
    plain = copy.deepcopy(model)
    fuse(model)
    assert "mlp" in vars(model)
    fuse(model, trace=False)
    assert "mlp" not in vars(model) and type(model.inp) is nn.Linear
    assert_same(plain, model, torch.randn(4, 6, dtype=F64))


class Consumer(nn.Module):
    """Its forward (not analysable: an optional argument) keeps its input x for a matmul; its
    method ``head`` passes its own input to a Tanh, which keeps nothing of it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.lin, self.act = nn.Linear(8, 8), nn.Tanh()

    def forward(self, x, scale=None):
        return self.head(x) + x @ self.w

    def head(self, h):
        return self.lin(self.act(h))


class Producer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act, self.fc2, self.act2 = (nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8),
                                                  nn.Tanh())
        self.cons = Consumer()

    def forward(self, x):
        return self.cons(self.act2(self.fc2(self.act(self.fc(x)))))


def test_a_method_graph_says_nothing_of_what_the_module_does_with_its_input():
    """The run fc..act2 feeds cons, whose analysed graph is its method head's: what head does with
    its own input is not what cons does with x (kept by the matmul), so the trailing tanh's
    output counts as maybe kept and the unit ends at fc2."""
    torch.manual_seed(0)
    model = Producer().double()
    plain = copy.deepcopy(model)
    _, report = fuse(model)
    assert [d.layers for d in report.fused if d.layers[0] == "fc"] == [("fc", "act", "fc2")]
    assert_same(plain, model, torch.randn(3, 4, dtype=F64))

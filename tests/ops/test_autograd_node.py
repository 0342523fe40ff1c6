"""The C++ autograd node that the mlp op records in eager autograd, for every activation and mixed
runs, linear_tanh and tanh_mlp included (csrc/autograd_node.cpp).

Covers: where it is recorded and where the autograd Functions still are (torch.func, forward-mode
AD, dispatch modes, tensor subclasses, torch.compile's tracing); that its gradients equal the
Functions' to the bit; that it behaves as any autograd node (saved-tensor hooks, the in-place
check, retain_graph, backward twice, tensor and node hooks, anomaly mode, only the gradients the
pass uses, the profiler's view); and what it is for, in exact bytes: the first-order backward frees
the incoming gradient after the top layer's elementwise pass, so the write-up's mean-loss chain
peaks no higher than plain autograd, fused as one stack or pair by pair.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ckpt_ext
from ckpt_ext import FusedLinearTanh, FusedTanhMLP, linear_tanh, tanh_mlp
from ckpt_ext._activations import REGISTRY
from ckpt_ext.memory import MemoryMeter, clear_grads, measured_step
from ckpt_ext.models import Net

# linear_tanh and tanh_mlp are the mlp op: its node, and its Function's
NODE = {"tanh_mlp": "MlpBackward", "linear_tanh": "MlpBackward"}
FUNCTION = {"tanh_mlp": "_MlpBackward", "linear_tanh": "_MlpBackward"}


class Passthrough(TorchDispatchMode):
    """A dispatch mode that changes nothing but is there: the ops then go through the Python
    Functions (what any mode, FakeTensorMode or FlopCounterMode included, gets)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _params(sizes, bias=(True,), dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    ws, bs = [], []
    for i, (k, n) in enumerate(zip(sizes[:-1], sizes[1:])):
        ws.append((torch.randn(n, k, generator=g, dtype=dtype) / k ** 0.5).requires_grad_())
        b = bias[i % len(bias)]
        bs.append(torch.randn(n, generator=g, dtype=dtype).requires_grad_() if b else None)
    return ws, bs


def _run(op, x, ws, bs, last_tanh=True):
    if op == "linear_tanh":
        return linear_tanh(x, ws[0], bs[0])
    return tanh_mlp(x, ws, bs, last_tanh=last_tanh)


# ------------------------------------------------------------------------------------------------
# the release-dependent paths (csrc/autograd_node.cpp, "torch releases")

def _torch_minor():
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    return major, minor


def test_the_node_path_compiled_is_the_one_for_this_torch():
    # Node is handed around by intrusive_ptr from torch 2.13 on, by shared_ptr up to 2.12 (read
    # off each release's headers); node-creation hooks exist from 2.14 on.
    version = _torch_minor()
    assert ckpt_ext._C.AUTOGRAD_NODE_CREATION_HOOKS == (version >= (2, 14))
    expected = {(2, 11): "shared_ptr", (2, 12): "shared_ptr", (2, 13): "intrusive_ptr",
                (2, 14): "intrusive_ptr"}
    if version in expected:
        assert ckpt_ext._C.AUTOGRAD_NODE_OWNERSHIP == expected[version]
    assert ckpt_ext._C.AUTOGRAD_NODE_OWNERSHIP in ("shared_ptr", "intrusive_ptr")


@pytest.mark.parametrize("op", ["tanh_mlp", "linear_tanh"])
def test_node_creation_hooks_see_the_node_with_its_saved_tensors(op):
    if not ckpt_ext._C.AUTOGRAD_NODE_CREATION_HOOKS:
        assert not hasattr(torch.autograd.graph, "node_creation_hook")
        pytest.skip(f"torch {torch.__version__} has no node-creation hooks")
    ws, bs = _params([5, 7, 3])
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    seen = []
    with torch.autograd.graph.node_creation_hook(lambda node: seen.append(node)):
        y = _run(op, x, ws, bs)
    assert type(y.grad_fn).__name__ == NODE[op]
    ours = [n for n in seen if type(n).__name__ == NODE[op]]
    assert ours == [y.grad_fn]
    y.sum().backward()  # the node the hook saw is the one that runs
    assert x.grad is not None


# ------------------------------------------------------------------------------------------------
# where the node is recorded

@pytest.mark.parametrize("op", ["tanh_mlp", "linear_tanh"])
@pytest.mark.parametrize("bias", [True, False])
def test_eager_records_the_cpp_node(op, bias):
    ws, bs = _params([4, 6, 3] if op == "tanh_mlp" else [4, 6], (bias,))
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    y = _run(op, x, ws, bs)
    node = y.grad_fn
    assert node.name() == NODE[op] and type(node).__name__ == NODE[op]
    assert isinstance(node, torch.autograd.graph.Node)
    # one next edge per tensor: x, the weights, the biases that exist
    n_b = sum(b is not None for b in bs)
    assert len(node.next_functions) == 1 + len(ws) + n_b
    assert all(type(f).__name__ == "AccumulateGrad" for f, _ in node.next_functions)


def test_modules_record_the_cpp_node():
    x = torch.randn(5, 4, requires_grad=True)
    assert FusedTanhMLP([4, 6, 3])(x).grad_fn.name() == "MlpBackward"
    assert FusedLinearTanh(4, 6)(x).grad_fn.name() == "MlpBackward"


@pytest.mark.parametrize("op", ["tanh_mlp", "linear_tanh"])
def test_functions_under_a_dispatch_mode(op):
    ws, bs = _params([4, 6, 3])
    x = torch.randn(5, 4, dtype=torch.float64)
    with Passthrough():
        y = _run(op, x, ws, bs)
    assert y.grad_fn.name() == FUNCTION[op]


@pytest.mark.parametrize("op", ["tanh_mlp", "linear_tanh"])
def test_functions_under_torch_func_and_forward_ad(op):
    ws, bs = _params([4, 6, 3])
    x = torch.randn(5, 4, dtype=torch.float64)
    seen = []

    def f(x):
        y = _run(op, x, ws, bs)
        seen.append(y.grad_fn.name())
        return y.sum()

    torch.func.grad(f)(x)
    assert seen == [FUNCTION[op]]
    with fwAD.dual_level():
        y = _run(op, fwAD.make_dual(x, torch.ones_like(x)), ws, bs)
        assert y.grad_fn.name() == FUNCTION[op]
        assert fwAD.unpack_dual(y).tangent is not None


def test_function_for_a_tensor_subclass():
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    ws, bs = _params([4, 6, 3])
    x = two_tensor.TwoTensor(torch.randn(5, 4, dtype=torch.float64),
                             torch.randn(5, 4, dtype=torch.float64)).requires_grad_()
    y = tanh_mlp(x, ws, bs)
    assert y.grad_fn.name() == "_MlpBackward"
    y.sum().backward()
    assert x.grad is not None


def test_compile_traces_the_ops_not_the_node():
    # torch.compile traces with FakeTensors (a Python key): the Functions, whose backward op lands
    # in the compiled backward graph; the compiled step computes what eager computes.
    ws, bs = _params([4, 6, 3], dtype=torch.float32)
    x = torch.randn(5, 4)

    def step(x):
        return tanh_mlp(x, ws, bs).mean()

    torch._dynamo.reset()
    loss = torch.compile(step, backend="aot_eager", fullgraph=True)(x)
    assert loss.grad_fn.name() == "CompiledFunctionBackward"
    got = torch.autograd.grad(loss, ws + [bs[0], bs[1]])
    want = torch.autograd.grad(step(x), ws + [bs[0], bs[1]])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


# ------------------------------------------------------------------------------------------------
# the same gradients as the Functions

CASES = [  # (sizes, bias pattern, last_tanh, which inputs require grad: x, weights, biases)
    ([7, 9, 5, 3], (True,), True, (True, True, True)),
    ([7, 9, 5, 3], (True, False), False, (True, True, True)),
    ([7, 9, 5, 3], (False,), True, (False, True, False)),
    ([7, 9, 5, 3], (True,), False, (True, False, False)),
    ([7, 3], (True,), True, (True, True, True)),
]


@pytest.mark.parametrize("sizes,bias,last_tanh,req", CASES)
@pytest.mark.parametrize("grad_kind", ["mean", "tensor"])
def test_node_gradients_equal_the_functions_bitwise(sizes, bias, last_tanh, req, grad_kind):
    def grads(mode):
        ws, bs = _params(sizes, bias)
        x = torch.randn(2, 3, sizes[0], dtype=torch.float64,
                        generator=torch.Generator().manual_seed(1))
        x.requires_grad_(req[0])
        for w in ws:
            w.requires_grad_(req[1])
        for b in bs:
            if b is not None:
                b.requires_grad_(req[2])
        with mode:
            y = tanh_mlp(x, ws, bs, last_tanh=last_tanh)
        assert y.grad_fn.name() == ("_MlpBackward" if isinstance(mode, Passthrough)
                                    else "MlpBackward")
        if grad_kind == "mean":
            y.mean().backward()
        else:
            y.backward(torch.randn(y.shape, dtype=y.dtype,
                                   generator=torch.Generator().manual_seed(2)))
        return [t.grad for t in [x, *ws, *bs] if t is not None]

    node, function = grads(contextlib.nullcontext()), grads(Passthrough())
    for a, b in zip(node, function):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)


def test_create_graph_through_the_node_matches_plain_autograd():
    # create_graph=True goes through the node's Python path (the Functions' backward): u_x, u_xx
    # and the parameter gradient of both, against nn.Sequential, float64.
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    seq = seq.double()
    fused = FusedTanhMLP.from_modules(seq)
    tx = torch.rand(16, 2, dtype=torch.float64, requires_grad=True)

    def loss(model):
        u = model(tx)
        (du,) = torch.autograd.grad(u.sum(), tx, create_graph=True)
        (ddu,) = torch.autograd.grad(du[:, 1].sum(), tx, create_graph=True)
        return (ddu[:, 1] ** 2).mean() + (u ** 2).mean()

    assert fused(tx).grad_fn.name() == "MlpBackward"
    want = torch.autograd.grad(loss(seq), list(seq.parameters()))
    got = torch.autograd.grad(loss(fused), list(seq.parameters()))
    for g, w in zip(got, want):
        assert (g - w).norm() <= 1e-12 * w.norm()


# ------------------------------------------------------------------------------------------------
# an autograd node like any other

def test_saved_tensor_hooks_see_what_is_saved_and_unpack_it():
    ws, bs = _params([4, 6, 3])
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    packed, unpacked = [], []

    def pack(t):
        packed.append(t)
        return t.clone()  # the node must use what unpack returns

    def unpack(t):
        unpacked.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        y = tanh_mlp(x, ws, bs)
    assert y.grad_fn.name() == "MlpBackward"
    assert [p.data_ptr() for p in packed] == [t.data_ptr() for t in [x, *ws, *bs]]
    y.sum().backward()
    assert len(unpacked) == len(packed) == 5
    ref = [t.grad.clone() for t in [x, *ws, *bs]]
    for t in [x, *ws, *bs]:
        t.grad = None
    tanh_mlp(x, ws, bs).sum().backward()
    assert all(torch.equal(a, t.grad) for a, t in zip(ref, [x, *ws, *bs]))


@pytest.mark.parametrize("op", ["tanh_mlp", "linear_tanh"])
def test_in_place_modification_of_a_saved_tensor_raises(op):
    ws, bs = _params([4, 6, 3])
    base = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    x = base * 1
    y = _run(op, x, ws, bs)
    x.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    y = _run(op, base, ws, bs)
    with torch.no_grad():
        ws[0].mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("op", ["tanh_mlp", "linear_tanh"])
def test_retain_graph_and_backward_twice(op):
    ws, bs = _params([4, 6, 3])
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    y = _run(op, x, ws, bs)
    y.mean().backward(retain_graph=True)
    once = [t.grad.clone() for t in (x, ws[0], bs[0])]
    y.mean().backward()  # the saved tensors are still there: gradients accumulate
    for a, t in zip(once, (x, ws[0], bs[0])):
        assert torch.equal(t.grad, 2 * a)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.mean().backward()


def test_tensor_and_node_hooks_run():
    ws, bs = _params([4, 6, 3])
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    y = tanh_mlp(x, ws, bs)
    y.sum().backward()
    ref_x, ref_w = x.grad.clone(), ws[0].grad.clone()
    x.grad = None
    ws[0].grad = None

    y = tanh_mlp(x, ws, bs)
    y.retain_grad()
    seen = {}
    y.register_hook(lambda g: 3 * g)  # the node gets 3x the gradient

    def keep(key, value):
        seen[key] = value  # and return None: the hooks change nothing

    x.register_hook(lambda g: keep("x", g.clone()))
    y.grad_fn.register_prehook(lambda grad_outputs: keep("pre", grad_outputs[0].clone()))
    y.grad_fn.register_hook(lambda grad_inputs, grad_outputs: keep("post", grad_inputs))
    y.sum().backward()
    assert torch.equal(seen["pre"], torch.full_like(y, 3.0))
    torch.testing.assert_close(x.grad, 3 * ref_x, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(ws[0].grad, 3 * ref_w, rtol=1e-12, atol=1e-15)
    assert torch.equal(seen["x"], x.grad)
    assert len(seen["post"]) == 1 + 2 + 2 and torch.equal(seen["post"][0], x.grad)
    assert torch.equal(y.grad, seen["pre"])  # retain_grad runs after the tensor hooks


def test_anomaly_mode_names_the_node():
    ws, bs = _params([4, 6, 3])
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    with torch.autograd.detect_anomaly(check_nan=True):
        y = tanh_mlp(x, ws, bs)
        with pytest.raises(RuntimeError, match="Function 'MlpBackward' returned nan values"):
            y.backward(torch.full_like(y, float("nan")))


def test_only_the_gradients_the_pass_uses_are_computed():
    # autograd.grad w.r.t. x: no weight-gradient GEMM. Per layer the backward runs one mm for
    # the gradient to the layer below and one more for grad_W when it is used (the recompute is
    # addmm). The profiler sees the op's name, as when the op ran through the dispatcher, and,
    # with record_shapes, the shapes it was given.
    ws, bs = _params([4, 6, 3], dtype=torch.float32)
    x = torch.randn(5, 4, requires_grad=True)

    def mm_calls(inputs):
        y = tanh_mlp(x, ws, bs)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    record_shapes=True) as prof:
            grads = torch.autograd.grad(y.sum(), inputs)
        events = prof.events()
        op = [e for e in events if e.name == "ckpt_ext::mlp_backward"]
        assert len(op) == 1 and op[0].input_shapes[:2] == [[5, 3], [5, 4]]
        return sum(e.name == "aten::mm" for e in events), grads

    n_x, (gx,) = mm_calls([x])
    n_all, grads = mm_calls([x, *ws])
    assert (n_x, n_all) == (2, 4)
    assert torch.equal(gx, grads[0])


def test_an_error_in_the_python_path_reaches_the_caller(monkeypatch):
    # create_graph=True goes through Python (_autograd_node._node_backward, which calls the mlp
    # Function's first order): an exception raised there comes out of autograd.grad as itself, as
    # from a Function's backward.
    from ckpt_ext import _mlp_autograd

    def boom(*args, **kwargs):
        raise ValueError("boom from the node's Python path")

    ws, bs = _params([4, 6, 3])
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    y = tanh_mlp(x, ws, bs)
    monkeypatch.setattr(_mlp_autograd, "_tanh_stack_first_order", boom)
    with pytest.raises(ValueError, match="boom from the node's Python path"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


def test_bad_input_raises_the_ops_message_and_saves_nothing():
    packed = []
    x = torch.randn(5, 7, requires_grad=True)
    w = torch.randn(3, 4, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        with pytest.raises(ValueError, match=r"weights\[0\]\.shape\[1\] \(in_features\) must equal "
                           r"x\.shape\[-1\] = 7"):
            tanh_mlp(x, [w])
        with pytest.raises(ValueError, match=r"x\.shape\[-1\] must equal weight\.shape\[1\]"):
            linear_tanh(x, w)
    assert packed == []


class _NoGrad(torch.autograd.Function):
    """Passes y on and sends no gradient back: the node below gets an undefined gradient."""

    @staticmethod
    def forward(ctx, y):
        return y.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


@pytest.mark.parametrize("op", ["tanh_mlp", "linear_tanh"])
def test_an_undefined_incoming_gradient_gives_no_gradients(op):
    # As ATen's nodes: a zero (undefined) gradient in, nothing out (the Function's node made
    # zero tensors instead).
    ws, bs = _params([4, 6, 3])
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    y = _run(op, x, ws, bs)
    (_NoGrad.apply(y).sum() + x.sum()).backward()
    assert torch.equal(x.grad, torch.ones_like(x)) and ws[0].grad is None


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_of_a_fused_module(use_reentrant):
    # Non-reentrant checkpoint packs through saved-tensor hooks and recomputes on unpack;
    # reentrant reruns the forward in backward: both through the node.
    torch.manual_seed(0)
    m = FusedTanhMLP([4, 6, 3]).double()
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    m(x).mean().backward()
    want = [t.grad for t in [x, *m.parameters()]]
    for t in [x, *m.parameters()]:
        t.grad = None
    y = torch.utils.checkpoint.checkpoint(m, x, use_reentrant=use_reentrant)
    y.mean().backward()  # (reentrant checkpoint refuses autograd.grad)
    for t, w in zip([x, *m.parameters()], want):
        assert torch.equal(t.grad, w)


# ------------------------------------------------------------------------------------------------
# what it is for: the peak, in exact bytes

class _Pairs(nn.Module):
    """The write-up's chain with each block a FusedLinearTanh sharing the block's Linear."""

    def __init__(self, net: Net):
        super().__init__()
        self.linear1 = net.linear1
        self.blocks = nn.Sequential(*[FusedLinearTanh.from_linear(b[0]) for b in net.blocks()])

    def forward(self, x):
        return self.blocks(self.linear1(x))


PEAK_SIZES = [dict(batch=256, in_features=16, hidden=64, depth=3),
              dict(batch=32, in_features=16, hidden=256, depth=3)]
PEAK_IDS = ["activation-bound", "weight-bound"]


def _chain(fused_as, sizes):
    torch.manual_seed(0)
    net = Net(mode="fused" if fused_as == "stack" else "plain", in_features=sizes["in_features"],
              hidden=sizes["hidden"], depth=sizes["depth"])
    return _Pairs(net) if fused_as == "pairs" else net


def _peak(model, sizes, forward_mode=None):
    """Peak bytes above "before forward" of one write-up step (loss out.mean()), exact CPU meter;
    the forward under ``forward_mode`` if given (the backward never is)."""
    x = torch.randn(sizes["batch"], sizes["in_features"])
    with MemoryMeter("cpu") as meter:
        clear_grads(model)
        if forward_mode is None:
            return measured_step(model, x, meter)["peak_above_before_forward"]

        def under_mode(inp):
            with forward_mode:
                return model(inp)

        return measured_step(under_mode, x, meter)["peak_above_before_forward"]


@pytest.mark.parametrize("sizes", PEAK_SIZES, ids=PEAK_IDS)
@pytest.mark.parametrize("fused_as", ["stack", "pairs"])
def test_mean_loss_chain_peak_not_above_plain(fused_as, sizes):
    fused = _peak(_chain(fused_as, sizes), sizes)
    plain = _peak(_chain("plain", sizes), sizes)
    assert 0 < fused <= plain, (fused, plain)


@pytest.mark.parametrize("sizes", PEAK_SIZES, ids=PEAK_IDS)
@pytest.mark.parametrize("fused_as", ["stack", "pairs"])
def test_the_node_peaks_one_gradient_below_the_function(fused_as, sizes):
    # The same step with the Python Function's node (the forward under a dispatch mode): its
    # backward holds the incoming (batch, hidden) gradient and the saved input to the end; the
    # C++ node frees the gradient after the top layer's elementwise pass and, without
    # retain_graph, the input after the last GEMM that reads it. At least that one buffer apart.
    model = _chain(fused_as, sizes)
    node = _peak(model, sizes)
    function = _peak(model, sizes, forward_mode=Passthrough())
    assert function - node >= sizes["batch"] * sizes["hidden"] * 4, (node, function)


@pytest.mark.parametrize("act", ["tanh", "gelu"])
def test_without_retain_graph_the_node_frees_its_input_before_grad_x(act):
    # One layer after a Linear, the layer's input held by nothing but the node: without
    # retain_graph the node lets it go before the walk allocates grad_x, so the step peaks lower
    # than with retain_graph (where the node must keep it); the gradients are the same bits.
    batch, width = 256, 64
    torch.manual_seed(0)
    first = nn.Linear(16, width)
    ws, bs = _params([width, width], dtype=torch.float32)
    peaks, grads = [], []
    for retain in (False, True):
        x = torch.randn(batch, 16, generator=torch.Generator().manual_seed(1))
        with MemoryMeter("cpu") as meter:
            for t in [*first.parameters(), *ws, *bs]:
                t.grad = None
            base = meter.current()
            meter.reset_peak()
            loss = ckpt_ext.mlp(first(x), ws, bs, activation=act).mean()
            loss.backward(retain_graph=retain)
            peaks.append(meter.peak() - base)
            del loss
        grads.append([t.grad.clone() for t in [*first.parameters(), *ws, *bs]])
    assert peaks[0] < peaks[1], peaks
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("act", ["tanh", "gelu", ["relu", "tanh"]], ids=["tanh", "gelu", "mixed"])
def test_cuda_node_gradients_equal_the_functions(act):
    def grads(mode):
        ws, bs = _params([7, 9, 3], dtype=torch.float32)
        ws = [w.detach().cuda().requires_grad_() for w in ws]
        bs = [b.detach().cuda().requires_grad_() for b in bs]
        torch.manual_seed(0)
        x = torch.randn(5, 7, device="cuda", requires_grad=True)
        with mode:
            y = ckpt_ext.mlp(x, ws, bs, activation=act)
        y.mean().backward()
        return y.grad_fn.name(), [t.grad for t in [x, *ws, *bs]]

    name_n, node = grads(contextlib.nullcontext())
    name_f, function = grads(Passthrough())
    assert (name_n, name_f) == ("MlpBackward", "_MlpBackward")
    for a, b in zip(node, function):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# every activation: mlp records the node too

ACTS = list(ckpt_ext.ACTIVATIONS)
MIXED = ["relu", "sin", "tanh"]


@pytest.mark.parametrize("act", ACTS + [MIXED], ids=ACTS + ["mixed"])
@pytest.mark.parametrize("grad_kind", ["mean", "tensor"])
def test_mlp_node_gradients_equal_the_functions_bitwise(act, grad_kind):
    def grads(mode):
        ws, bs = _params([5, 8, 7, 3], bias=(True, False), dtype=torch.float32)
        torch.manual_seed(0)
        x = torch.randn(6, 5, requires_grad=True)
        with mode:
            y = ckpt_ext.mlp(x, ws, bs, activation=act)
        if grad_kind == "mean":
            y.mean().backward()
        else:
            y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)))
        return y.grad_fn.name(), [t.grad for t in [x, *ws, *bs] if t is not None]

    name_n, node = grads(contextlib.nullcontext())
    name_f, function = grads(Passthrough())
    key = "mixed" if isinstance(act, list) else act
    assert (name_n, name_f) == ("MlpBackward", "_MlpBackward"), key
    for a, b in zip(node, function):
        assert torch.equal(a, b)


@pytest.mark.parametrize("act", ACTS + [MIXED], ids=ACTS + ["mixed"])
def test_mlp_node_create_graph_and_saved_tensor_hooks(act):
    ws, bs = _params([3, 6, 2], dtype=torch.float64)
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    acts = act if isinstance(act, str) else act[:2]
    y = ckpt_ext.mlp(x, ws, bs, activation=acts)
    (gx,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
    ref_y = x
    for i, (w, b) in enumerate(zip(ws, bs)):
        ref_y = REGISTRY[acts if isinstance(acts, str) else acts[i]].f(F.linear(ref_y, w, b))
    (ref_gx,) = torch.autograd.grad(ref_y.pow(2).sum(), x, create_graph=True)
    assert torch.allclose(gx, ref_gx, rtol=1e-12, atol=1e-14)
    (g2,) = torch.autograd.grad(gx.sum(), ws[0])
    (ref_g2,) = torch.autograd.grad(ref_gx.sum(), ws[0])
    assert torch.allclose(g2, ref_g2, rtol=1e-11, atol=1e-13)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        ckpt_ext.mlp(x, ws, bs, activation=acts).sum().backward()
    assert {id(t) for t in packed} <= {id(t) for t in [x, *ws, *bs]}


class _LinearThenMlp(nn.Module):
    """A Linear, then ``mlp`` over ``layers`` (width, width) layers with ``acts``."""

    def __init__(self, in_features, width, layers, acts):
        super().__init__()
        self.first = nn.Linear(in_features, width)
        ws, bs = _params([width] * (layers + 1), dtype=torch.float32)
        self.ws = nn.ParameterList([nn.Parameter(w.detach()) for w in ws])
        self.bs = nn.ParameterList([nn.Parameter(b.detach()) for b in bs])
        self.acts = acts

    def forward(self, x):
        return ckpt_ext.mlp(self.first(x), list(self.ws), list(self.bs), activation=self.acts)


@pytest.mark.parametrize("act", ACTS + [MIXED], ids=ACTS + ["mixed"])
@pytest.mark.parametrize("layers", [1, 3])
def test_mlp_node_peaks_below_the_function(act, layers):
    # A Linear, then the run; loss out.mean(). The Function's backward holds the incoming gradient
    # to its end, the C++ node frees it after the top layer's elementwise pass: one (batch, width)
    # buffer apart at least wherever the step peaks after that pass (one layer, every activation;
    # a tanh or relu stack). A stack of activations whose backward reads z peaks in the recompute
    # instead (z_0, z_1, the top input made again and z_2 beside the gradient, which both hold
    # there): lower with the node all the same, by the weight gradient then alive
    # (docs/design.md).
    batch, width = 256, 64
    acts = act if isinstance(act, str) else act[-layers:]
    torch.manual_seed(0)
    model = _LinearThenMlp(16, width, layers, acts)
    sizes = dict(batch=batch, in_features=16)
    node, function = _peak(model, sizes), _peak(model, sizes, forward_mode=Passthrough())
    if layers == 1 or acts in ("tanh", "relu"):  # (relu's stack holds its outputs, as tanh's)
        assert function - node >= batch * width * 4, (node, function)
    else:
        assert function - node >= width * (width + 1) * 4, (node, function)

"""The stack op ckpt_ext.tanh_mlp and its module FusedTanhMLP: a whole run of Linear layers with tanh
between them, kept for backward as its input only and recomputed in one op.

Against a float64 nn.Sequential reference on odd widths, depths 1-5, leading dims, bias or not and
both last_tanh; gradcheck / gradgradcheck; opcheck with every gradient mask; poisoned buffers; what
autograd saves (x only); the backward's peak against plain autograd's, in exact bytes; FLOP counts;
autocast; torch.compile with a dynamic batch; bad input naming the layer; the module's
initialisation, state_dict keys and parameter sharing.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import ckpt_ext
from ckpt_ext import FusedTanhMLP, tanh_mlp
from ckpt_ext.memory import MemoryMeter
from reference import TOL, rel_err


def _sequential(sizes, bias, last_tanh, dtype=torch.float64):
    layers = []
    for i, (k, n) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(k, n, bias=bias, dtype=dtype))
        if i + 2 < len(sizes) or last_tanh:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def _stack_params(sizes, bias, seed, dtype, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ws = [(torch.randn(n, k, generator=g) / max(k, 1) ** 0.5) for k, n in zip(sizes[:-1], sizes[1:])]
    bs = [torch.randn(n, generator=g) if bias else None for n in sizes[1:]]
    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype)
    return [cast(w) for w in ws], [cast(b) for b in bs]


def _outputs_and_grads(fn, x, ws, bs, gy):
    leaves = [t.detach().requires_grad_() for t in [x, *ws, *[b for b in bs if b is not None]]]
    x_, ws_ = leaves[0], leaves[1:1 + len(ws)]
    it = iter(leaves[1 + len(ws):])
    bs_ = [next(it) if b is not None else None for b in bs]
    y = fn(x_, ws_, bs_)
    y.backward(gy)
    return y.detach(), [t.grad for t in leaves]


def _ref_outputs_and_grads(x, ws, bs, gy, last_tanh):
    """Output and grads of the float64 reference (stock F.linear + torch.tanh), on the CPU."""
    return _outputs_and_grads(lambda x, ws, bs: _ref_graph(x, ws, bs, last_tanh),
                              x.double().cpu(), [w.double().cpu() for w in ws],
                              [None if b is None else b.double().cpu() for b in bs],
                              gy.double().cpu())


def _ref_graph(x, ws, bs, last_tanh):
    """The stack written with stock ops."""
    h = x
    for i, (w, b) in enumerate(zip(ws, bs)):
        h = torch.nn.functional.linear(h, w, b)
        if i + 1 < len(ws) or last_tanh:
            h = torch.tanh(h)
    return h


# (leading dims, sizes): depths 1-5, odd widths, 0 rows, in_features 0.
SHAPES = [
    ((5,), [3, 7]),
    ((17,), [9, 33, 5]),
    ((2, 3), [4, 1, 6, 2]),
    ((33,), [17, 9, 9, 31, 3]),
    ((3, 1, 7), [5, 8, 3, 11, 2, 13]),
    ((0,), [4, 6, 3]),
    ((6,), [0, 5, 4]),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("last_tanh", [True, False], ids=["last_tanh", "last_linear"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("lead,sizes", SHAPES, ids=lambda v: str(v))
def test_matches_float64_sequential(poison, lead, sizes, bias, last_tanh, dtype):
    seed = hash((lead, tuple(sizes), bias, last_tanh)) % 2**31
    ws, bs = _stack_params(sizes, bias, seed, dtype)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(*lead, sizes[0], generator=g).to(dtype)
    gy = torch.randn(*lead, sizes[-1], generator=g).to(dtype)
    got_y, got = _outputs_and_grads(lambda x, w, b: tanh_mlp(x, w, b, last_tanh), x, ws, bs, gy)
    ref_y, ref = _ref_outputs_and_grads(x, ws, bs, gy, last_tanh)
    # Half types: the stack compounds one storage rounding per layer (the GEMM output and the
    # activation); the bound grows with depth like stock nn.Sequential's own error does.
    tol = TOL[dtype] * (len(sizes) - 1 if dtype in (torch.bfloat16, torch.float16) else 1)
    assert got_y.dtype == dtype
    assert rel_err(got_y, ref_y) <= tol, "out"
    for i, (o, r) in enumerate(zip(got, ref)):
        assert o is not None and o.dtype == dtype, i
        assert rel_err(o, r) <= tol, (i, rel_err(o, r))


def test_one_layer_with_last_tanh_is_linear_tanh_bitwise():
    ws, bs = _stack_params([13, 21], True, 0, torch.float32)
    x = torch.randn(37, 13)
    gy = torch.randn(37, 21)
    y1, g1 = _outputs_and_grads(lambda x, w, b: tanh_mlp(x, w, b), x, ws, bs, gy)
    y2, g2 = _outputs_and_grads(lambda x, w, b: ckpt_ext.linear_tanh(x, w[0], b[0]), x, ws, bs, gy)
    assert torch.equal(y1, y2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("last_tanh", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_gradcheck_and_gradgradcheck_float64(bias, last_tanh):
    ws, bs = _stack_params([3, 4, 2, 3], bias, 5, torch.float64)
    x = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)
    params = [t.requires_grad_() for t in ws + [b for b in bs if b is not None]]

    def f(x, *p):
        w = list(p[:3])
        b = list(p[3:]) if bias else None
        return tanh_mlp(x, w, b, last_tanh)

    assert torch.autograd.gradcheck(f, (x, *params))
    assert torch.autograd.gradgradcheck(f, (x, *params))


def test_layers_without_bias_mixed_with_layers_with_bias():
    ws, _ = _stack_params([5, 6, 7, 4], False, 1, torch.float64)
    bs = [torch.randn(6, dtype=torch.float64), None, torch.randn(4, dtype=torch.float64)]
    x = torch.randn(9, 5, dtype=torch.float64)
    gy = torch.randn(9, 4, dtype=torch.float64)
    got_y, got = _outputs_and_grads(lambda x, w, b: tanh_mlp(x, w, b), x, ws, bs, gy)
    ref_y, ref = _ref_outputs_and_grads(x, ws, bs, gy, True)
    assert rel_err(got_y, ref_y) <= 1e-12
    assert len(got) == 1 + 3 + 2
    for o, r in zip(got, ref):
        assert rel_err(o, r) <= 1e-12


# ------------------------------------------------------------------------------------------------
# opcheck and the gradient masks

def _op_args(bias=True, last_tanh=True, lead=(3, 5), sizes=(4, 6, 3)):
    ws, bs = _stack_params(list(sizes), bias, 2, torch.float32)
    x = torch.randn(*lead, sizes[0])
    has = [b is not None for b in bs]
    return x, ws, [b for b in bs if b is not None], has, last_tanh


@pytest.mark.parametrize("last_tanh", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_opcheck_tanh_stack(bias, last_tanh):
    x, ws, bs, has, lt = _op_args(bias, last_tanh)
    torch.library.opcheck(torch.ops.ckpt_ext.mlp.default, (x, ws, bs, has, "tanh", lt))
    for t in [x, *ws, *bs]:
        t.requires_grad_()
    torch.library.opcheck(torch.ops.ckpt_ext.mlp.default, (x, ws, bs, has, "tanh", lt))


MASKS = list(itertools.product([True, False], repeat=5))  # need_x, need_w0..1, need_b0..1


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: "".join("1" if v else "0" for v in m))
def test_opcheck_and_values_of_the_tanh_stack_backward_for_every_mask(poison, mask):
    x, ws, bs, has, lt = _op_args(True, False, lead=(37,), sizes=(5, 7, 3))
    x, ws, bs = x.double(), [w.double() for w in ws], [b.double() for b in bs]
    gy = torch.randn(37, 3, dtype=torch.float64)
    need_x, nw0, nw1, nb0, nb1 = mask
    args = (gy, x, ws, bs, has, "tanh", lt, need_x, [nw0, nw1], [nb0, nb1])
    torch.library.opcheck(torch.ops.ckpt_ext.mlp_backward.default, args)
    gx, gws, gbs = torch.ops.ckpt_ext.mlp_backward(*args)
    _, ref = _ref_outputs_and_grads(x, ws, bs, gy, lt)
    assert (gx is None) == (not need_x)
    if need_x:
        assert rel_err(gx, ref[0]) <= 1e-12
    assert len(gws) == nw0 + nw1 and len(gbs) == nb0 + nb1
    want_w = [r for r, n in zip(ref[1:3], (nw0, nw1)) if n]
    want_b = [r for r, n in zip(ref[3:5], (nb0, nb1)) if n]
    for got, r in zip(gws + gbs, want_w + want_b):
        assert rel_err(got, r) <= 1e-12


def test_autograd_asks_only_for_what_is_needed():
    # Only the first layer's weight requires grad: no grad_x, no other weight or bias grads, and
    # the backward still walks down to layer 0.
    ws, bs = _stack_params([4, 5, 3], True, 3, torch.float32)
    ws[0].requires_grad_()
    x = torch.randn(6, 4)
    with FlopCounterMode(display=False) as fc:
        tanh_mlp(x, ws, bs).sum().backward()
    assert ws[0].grad is not None and ws[1].grad is None and bs[0].grad is None
    flops = fc.get_total_flops()
    m = 6
    fwd = 2 * m * (4 * 5 + 5 * 3)
    # recompute both layers (last_tanh), grad_W0 and the gradient through layer 1 to layer 0
    bwd = 2 * m * (4 * 5 + 5 * 3) + 2 * m * 4 * 5 + 2 * m * 5 * 3
    assert flops == fwd + bwd


class _Passthrough(TorchDispatchMode):
    """A dispatch mode that changes nothing: under it the C++ node steps aside and the Python
    Functions record the graph."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("op", ["tanh_mlp", "mlp_gelu"])
@pytest.mark.parametrize("bias", [True, False])
def test_the_gradient_of_each_parameter_alone_on_the_python_path(op, bias):
    """torch.autograd.grad for one parameter at a time, first and second order (through the
    x-gradient), with the Python Functions: each node's edges are those of its tensor inputs only,
    past its flags, and the gradient asked for is computed from its own edge."""
    ws, bs = _stack_params([3, 5, 4, 2], bias, 11, torch.float64)
    params = [p.requires_grad_() for p in ws + (bs if bias else [])]
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)

    def fused(x):
        if op == "tanh_mlp":
            return tanh_mlp(x, ws, bs if bias else None)
        return ckpt_ext.mlp(x, ws, bs if bias else None, activation="gelu")

    act = torch.tanh if op == "tanh_mlp" else torch.nn.functional.gelu

    def plain(x):
        a = x
        for w, b in zip(ws, bs if bias else [None] * len(ws)):
            a = act(torch.nn.functional.linear(a, w, b))
        return a

    for p in params:
        with _Passthrough():
            y = fused(x)
            g1 = torch.autograd.grad(y.pow(2).sum(), [p])[0]
            gx = torch.autograd.grad(fused(x).sum(), [x], create_graph=True)[0]
            g2 = torch.autograd.grad(gx.pow(2).sum(), [p])[0]
        r1 = torch.autograd.grad(plain(x).pow(2).sum(), [p])[0]
        rx = torch.autograd.grad(plain(x).sum(), [x], create_graph=True)[0]
        r2 = torch.autograd.grad(rx.pow(2).sum(), [p])[0]
        # second order: measured up to 2.2e-15 where the reference's torch.tanh is Sleef's
        # (AVX-512), 1 ulp from ckpt_ext's kernel
        assert rel_err(g1, r1) <= TOL[torch.float64] and rel_err(g2, r2) <= 1e-14


# ------------------------------------------------------------------------------------------------
# memory: what is saved, and the backward's peak in exact bytes

def test_saves_only_x_and_parameter_references():
    m = FusedTanhMLP([16, 64, 64, 8])
    x = torch.randn(32, 16, requires_grad=True)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        m(x)
    params = {p.data_ptr() for p in m.parameters()}
    activations = [t for t in packed if t.data_ptr() not in params]
    assert len(activations) == 1 and activations[0].data_ptr() == x.data_ptr()
    assert len(packed) == 1 + 3 + 3


def _step_memory(model, x, explicit_grad):
    """(kept for backward, peak during backward, peak of the step) in bytes, measured by the exact
    CPU meter around one step; parameter grads start as None."""
    for p in model.parameters():
        p.grad = None
    with MemoryMeter("cpu") as meter:
        xs = x.clone()
        gy = torch.randn(x.shape[0], 24) if explicit_grad else None
        base = meter.current()
        meter.reset_peak()
        out = model(xs)
        loss = out.mean() if gy is None else None
        if loss is not None:
            del out
        held = loss if loss is not None else out  # what the test itself holds
        kept = meter.current() - base - held.numel() * held.element_size()
        del held
        meter.reset_peak()
        if loss is not None:
            loss.backward()
        else:
            out.backward(gy)
        bwd_peak = meter.peak() - base
    return kept, bwd_peak


@pytest.mark.parametrize("explicit_grad", [False, True], ids=["mean_loss", "grad_tensor"])
@pytest.mark.parametrize("last_tanh", [True, False])
def test_backward_peak_not_above_plain_autograd(last_tanh, explicit_grad):
    torch.manual_seed(0)
    sizes = [48, 96, 80, 64, 24]
    plain = _sequential(sizes, True, last_tanh, dtype=torch.float32)
    fused = FusedTanhMLP.from_modules(plain)
    x = torch.randn(512, 48)
    kept_p, peak_p = _step_memory(plain, x, explicit_grad)
    kept_f, peak_f = _step_memory(fused, x, explicit_grad)
    # Kept: plain keeps every Linear's input and every tanh output (the same tensors, one storage
    # each, the last tanh's output included); fused keeps nothing but x, which the caller holds.
    assert kept_f == 0
    # (with an explicit grad the test holds the output, which is the last tanh's saved output)
    assert kept_p == 512 * (96 + 80 + 64 + (24 if last_tanh and not explicit_grad else 0)) * 4
    assert peak_f <= peak_p, (peak_f, peak_p)


# ------------------------------------------------------------------------------------------------
# FLOPs: fused = plain + exactly the recomputed forward GEMMs

@pytest.mark.parametrize("last_tanh", [True, False])
def test_flops_are_plain_plus_the_recompute(last_tanh):
    sizes = [7, 20, 30, 10]
    torch.manual_seed(0)
    plain = _sequential(sizes, True, last_tanh, dtype=torch.float32)
    fused = FusedTanhMLP.from_modules(plain)
    x = torch.randn(11, 7, requires_grad=True)

    def count(model):
        with FlopCounterMode(display=False) as fc:
            model(x).sum().backward()
        return fc.get_total_flops()

    m = 11
    gemms = [2 * m * k * n for k, n in zip(sizes[:-1], sizes[1:])]
    recompute = sum(gemms[:-1]) + (gemms[-1] if last_tanh else 0)
    assert count(fused) == count(plain) + recompute


# ------------------------------------------------------------------------------------------------
# autocast, torch.compile

def test_autocast_bf16_matches_float64_within_bf16_and_matches_sequential():
    torch.manual_seed(0)
    plain = _sequential([32, 64, 48, 16], True, True, dtype=torch.float32)
    fused = FusedTanhMLP.from_modules(plain)
    x = torch.randn(64, 32)
    ref = _ref_graph(x.double(), [m.weight.double() for m in plain if isinstance(m, nn.Linear)],
                     [m.bias.double() for m in plain if isinstance(m, nn.Linear)], True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yf = fused(x)
        yp = plain(x)
    assert yf.dtype == torch.bfloat16
    err_f, err_p = rel_err(yf, ref), rel_err(yp, ref)
    # measured: fused 3.5e-3, nn.Sequential 3.5e-3 (bf16 half-ulp 3.9e-3 per rounding)
    assert err_f <= 1e-2 and err_f <= 2 * err_p
    yf.float().sum().backward()
    for p in fused.parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32


def test_compile_fullgraph_dynamic_batch_one_graph():
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = FusedTanhMLP([8, 16, 16, 4], last_tanh=False)
    # aot_eager: the same Dynamo + AOTAutograd tracing as inductor (the Meta kernel runs with
    # symbolic sizes), without codegen.
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(m, fullgraph=True, dynamic=True, backend=counter)
    for batch in (5, 9, 17):
        x = torch.randn(batch, 8, requires_grad=True)
        y = compiled(x)
        ref = m(x)
        assert rel_err(y, ref) <= 1e-6
        y.sum().backward()
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_compile_inductor_keeps_the_stack_op_whole():
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = FusedTanhMLP([8, 16, 16, 4])
    x = torch.randn(6, 8, requires_grad=True)
    from torch._inductor.utils import run_and_get_code

    def step():
        y = torch.compile(m, fullgraph=True)(x)
        y.sum().backward()
        return y

    y, codes = run_and_get_code(step)
    fwd, bwd = codes
    assert "torch.ops.ckpt_ext.mlp.default(" in fwd
    assert "torch.ops.ckpt_ext.mlp_backward.default(" in bwd
    assert rel_err(y, m(x)) <= 1e-6
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------------
# bad input: eager (C++ checks) and FakeTensor (the Meta kernel runs the same checks)

BAD = [
    ("empty_weights", lambda: (torch.randn(4, 5), [], None), ValueError,
     r"ckpt_ext.tanh_mlp: weights must hold at least one layer's weight, got an empty list"),
    ("in_features_layer0", lambda: (torch.randn(4, 5), [torch.randn(3, 6)], None), ValueError,
     r"weights\[0\].shape\[1\] \(in_features\) must equal x.shape\[-1\] = 5, got weights\[0\] of "
     r"shape \[3, 6\] and x of shape \[4, 5\]"),
    ("in_features_layer2", lambda: (torch.randn(4, 5), [torch.randn(3, 5), torch.randn(7, 3),
                                                        torch.randn(2, 6)], None), ValueError,
     r"weights\[2\].shape\[1\] \(in_features\) must equal weights\[1\].shape\[0\] \(out_features "
     r"of layer 1\) = 7, got weights\[2\] of shape \[2, 6\]"),
    ("weight_rank", lambda: (torch.randn(4, 5), [torch.randn(3, 5), torch.randn(3)], None),
     ValueError, r"weights\[1\] must be 2-D \(out_features, in_features\), got shape \[3\]"),
    ("bias_length", lambda: (torch.randn(4, 5), [torch.randn(3, 5), torch.randn(2, 3)],
                             [torch.randn(3), torch.randn(3)]), ValueError,
     r"biases\[1\] must have shape \[2\] \(out_features of layer 1\), got shape \[3\]"),
    ("weight_dtype", lambda: (torch.randn(4, 5), [torch.randn(3, 5),
                                                  torch.randn(2, 3, dtype=torch.float64)], None),
     TypeError, r"weights\[1\] must have the dtype of x \(Float\), got Double"),
    ("bias_dtype", lambda: (torch.randn(4, 5), [torch.randn(3, 5)], [torch.randn(3).half()]),
     TypeError, r"biases\[0\] must have the dtype of x \(Float\), got Half"),
    ("x_dtype", lambda: (torch.ones(4, 5, dtype=torch.int32), [torch.ones(3, 5, dtype=torch.int32)],
                         None), TypeError,
     r"x must be float32, float64, bfloat16 or float16, got Int"),
    ("x_scalar", lambda: (torch.tensor(1.0), [torch.randn(3, 1)], None), ValueError,
     r"x must have shape \(\.\.\., in_features\) with at least 1 dimension"),
]
DEVICE_BAD = [
    ("weight_device", lambda: (torch.randn(4, 5), [torch.randn(3, 5), torch.randn(2, 3,
                                                                                device="meta")],
                               None), ValueError,
     r"weights\[1\] must be on the device of x \(cpu\), got meta"),
]


@pytest.mark.parametrize("make,exc,pattern", [c[1:] for c in BAD + DEVICE_BAD],
                         ids=[c[0] for c in BAD + DEVICE_BAD])
def test_eager_rejects_bad_input_naming_the_layer(make, exc, pattern):
    x, ws, bs = make()
    with pytest.raises(exc, match=pattern):
        tanh_mlp(x, ws, bs)


@pytest.mark.parametrize("make,exc,pattern", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_fake_tensors_rejected_with_the_same_message(make, exc, pattern):
    x, ws, bs = make()
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        fws = [mode.from_tensor(w) for w in ws]
        fbs = None if bs is None else [mode.from_tensor(b) for b in bs]
        with pytest.raises(exc, match=pattern):
            tanh_mlp(fx, fws, fbs)


def test_biases_list_length_checked_in_python():
    with pytest.raises(ValueError, match=r"biases must have one entry \(a tensor or None\) per "
                                         r"layer \(2\), got 1"):
        tanh_mlp(torch.randn(2, 3), [torch.randn(4, 3), torch.randn(1, 4)], [None])


def test_backward_op_rejects_a_grad_out_of_the_wrong_shape():
    x, ws, bs, has, lt = _op_args()
    with pytest.raises(ValueError, match=r"mlp_backward: grad_out must have shape \[3, 5, 3\], "
                                         r"got \[3, 5, 4\]"):
        torch.ops.ckpt_ext.mlp_backward(torch.randn(3, 5, 4), x, ws, bs, has, "tanh", lt, True,
                                        [True, True], [True, True])


# ------------------------------------------------------------------------------------------------
# the module

@pytest.mark.parametrize("last_tanh", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_module_same_init_and_keys_as_sequential(bias, last_tanh):
    sizes = [7, 11, 5, 3]
    torch.manual_seed(7)
    seq = _sequential(sizes, bias, last_tanh, dtype=torch.float32)
    torch.manual_seed(7)
    fused = FusedTanhMLP(sizes, bias=bias, last_tanh=last_tanh)
    assert list(fused.state_dict()) == list(seq.state_dict())
    for (n1, a), (n2, b) in zip(fused.state_dict().items(), seq.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b)
    x = torch.randn(4, 7)
    assert rel_err(fused(x), seq(x)) <= 1e-6
    # and it loads the Sequential's checkpoint, strictly
    other = FusedTanhMLP(sizes, bias=bias, last_tanh=last_tanh)
    other.load_state_dict(seq.state_dict())
    assert torch.equal(other(x), fused(x))
    assert fused.sizes == sizes
    assert repr(fused).startswith(f"FusedTanhMLP(\n  sizes={sizes}, last_tanh={last_tanh}")


def test_from_modules_shares_the_linears_and_an_optimizer_keeps_training_them():
    torch.manual_seed(0)
    seq = _sequential([6, 8, 4], True, False, dtype=torch.float32)
    opt = torch.optim.SGD(seq.parameters(), lr=0.1)
    fused = FusedTanhMLP.from_modules(seq)
    assert fused.last_tanh is False
    assert fused._modules["0"] is seq[0] and fused._modules["2"] is seq[2]
    before = seq[0].weight.detach().clone()
    fused(torch.randn(5, 6)).pow(2).sum().backward()
    opt.step()
    assert not torch.equal(seq[0].weight, before)
    named = FusedTanhMLP.from_modules({"fc1": seq[0], "act": seq[1], "fc2": seq[2]})
    assert list(named.state_dict()) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


@pytest.mark.parametrize("modules,pattern", [
    (lambda: [], "the run is empty"),
    (lambda: [nn.Tanh(), nn.Linear(2, 3)], r"entry 0 must be exactly Linear"),
    (lambda: [nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2)], r"entry 1 must be exactly Tanh"),
    (lambda: [nn.Linear(2, 3), nn.Tanh(), nn.Linear(4, 2)],
     r"entry 2: in_features 4 does not match the previous Linear's out_features 3"),
    (lambda: [nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 2, dtype=torch.float64)],
     r"entry 2: weight is torch.float64"),
    (lambda: [nn.LazyLinear(3)], r"entry 0 must be exactly Linear"),
], ids=["empty", "starts_with_tanh", "relu", "widths", "dtypes", "subclass"])
def test_from_modules_refuses_what_it_cannot_fuse(modules, pattern):
    with pytest.raises(ValueError, match="FusedTanhMLP.from_modules: " + pattern):
        FusedTanhMLP.from_modules(modules())


def test_from_modules_refuses_hooks():
    lin = nn.Linear(2, 3)
    lin.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="entry 0 \\(Linear\\) has hooks"):
        FusedTanhMLP.from_modules([lin, nn.Tanh()])


def test_forward_refuses_a_replaced_or_hooked_layer():
    m = FusedTanhMLP([3, 4, 2])

    class Wrapped(nn.Linear):
        pass

    m._modules["2"] = Wrapped(4, 2)
    with pytest.raises(RuntimeError, match="layer '2' was replaced by Wrapped"):
        m(torch.randn(1, 3))
    m = FusedTanhMLP([3, 4, 2])
    m._modules["0"].register_forward_pre_hook(lambda *a: None)
    with pytest.raises(RuntimeError, match="layer '0' has hooks"):
        m(torch.randn(1, 3))


def test_module_rejects_too_few_sizes():
    with pytest.raises(ValueError, match=r"sizes must hold at least 2 entries"):
        FusedTanhMLP([4])


def test_forward_and_recompute_use_the_library_tanh_not_atens():
    # An unqualified tanh_(z) on an at::Tensor once resolved to at::tanh_ by argument-dependent
    # lookup, so the forward ran ATen's tanh and the recompute the library's: two tanh functions
    # where the design needs one. The profiler sees every ATen op the kernels call.
    ws, bs = _stack_params([5, 7, 3], True, 0, torch.float32)
    x = torch.randn(9, 5, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        tanh_mlp(x, ws, bs).sum().backward()
        ckpt_ext.linear_tanh(x, ws[0], bs[0]).sum().backward()
    names = {e.name for e in prof.events()}
    assert "ckpt_ext::mlp" in names and "ckpt_ext::mlp_backward" in names
    assert not names & {"aten::tanh", "aten::tanh_", "aten::tanh_backward"}, names

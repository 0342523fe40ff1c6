"""ckpt_ext.moe_experts, every layout: values and every gradient against the float64 reference
(tests/reference.py: moe_ref) in every dtype, odd shapes, zero tokens, experts without tokens,
pairs routed to no expert, poisoned buffers; the clamped gated product (gpt-oss's); against
transformers' own experts modules from tiny configs in each experts implementation they run on
the CPU; gradcheck/gradgradcheck, frozen parameters, torch.func, torch.compile, autocast, opcheck,
FLOPs, the GEMMs an unused expert does not run; what autograd keeps (saved-tensor hooks) against
transformers' module; bad input."""
from __future__ import annotations

import warnings

import pytest
import torch

import ckpt_ext
from reference import (kept_and_peak, measured, moe_grads, moe_inputs, moe_ref, moe_ref_grads,
                       rel_err, requires_gpu, scaled_err)
from _ecosys import saved_activation_bytes

LAYOUTS = list(ckpt_ext.MOE_LAYOUTS)
GATED = [name for name in LAYOUTS if not name.startswith("ungated")]
ACTS = list(ckpt_ext.ACTIVATIONS)
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
RESULTS = ("out", "grad_x", "grad_top_k_weights", "grad_gate_up", "grad_down",
           "grad_gate_up_bias", "grad_down_bias")

# Relative error bound per dtype against the float64 reference, for every result but the routing
# weights' gradient: ~5x the largest measured over seeds 0-29 (--seed-sweep=0:30 with
# CKPT_EXT_MEASURE) of every test below that calls _check: float64 8.0e-16, float32 4.2e-07,
# bfloat16 1.2e-02, float16 1.8e-03. Stock autograd on moe_ref in the same dtype measured float32
# 3.0e-07, bfloat16 1.2e-02, float16 2.1e-03 (seeds 0-29, four of the shapes below, silu).
MOE_REL_TOL = {torch.float64: 4e-15, torch.float32: 2e-6, torch.bfloat16: 5e-2,
               torch.float16: 8e-3}
# The routing weights' gradient, one dot product <y, gy> per pair of terms of either sign, is
# bounded against the sum of its terms' magnitudes, Σ_c |y_c·gy_c| (a sum that cancels is only as
# exact as that allows in any implementation; relative to the result, a one-token case measured
# 2.3e-14 in float64): ~5x the largest scaled error measured as above, float64 4.0e-16, float32
# 4.5e-07, bfloat16 1.5e-02, float16 1.3e-03.
MOE_WEIGHTS_COND_TOL = {torch.float64: 2e-15, torch.float32: 2e-6, torch.bfloat16: 8e-2,
                        torch.float16: 6e-3}
# One float32 computation against itself on other weight and input layouts: 4 ulps (float32 eps
# 1.2e-7), ~4x the largest measured over seeds 0-29, under this machine's kernels and under the
# dispatch step's (`make test-dispatch`; ATEN_CPU_CAPABILITY=default too): output 1.2e-07, the
# gradient through a stored view 3.8e-08.
LAYOUT_REL_TOL = 4 * torch.finfo(torch.float32).eps

# (lead dims, hidden, intermediate, experts, top_k, biases (gate_up, down), experts used): odd
# sizes, one token, zero tokens, a 3-D x, one expert, more experts than pairs (some get none),
# every token on two of eight experts.
SHAPES = [((7,), 6, 5, 3, 2, (True, True), None),
          ((33,), 42, 24, 8, 2, (False, False), None),
          ((1,), 6, 5, 1, 1, (True, False), None),
          ((0,), 6, 5, 3, 2, (True, True), None),
          ((2, 5), 6, 24, 3, 2, (False, True), None),
          ((3,), 42, 5, 8, 2, (True, True), None),
          ((33,), 6, 5, 8, 2, (True, True), [1, 5])]


def _weights_grad_scale(inputs, kw):
    """Σ_c |y_c·gy_c| per pair: y the pair's expert output, by moe_ref in float64."""
    x, idx, w, *params, gy = (t if t is None or not t.is_floating_point() else t.double().cpu()
                              for t in inputs)
    idx = idx.cpu()
    one = torch.ones_like(w[..., :1])
    ys = [moe_ref(x, idx[..., k:k + 1], one, *params, kw["activation"], kw["layout"],
                  kw.get("limit"), kw.get("up_offset", 0.0)) for k in range(idx.shape[-1])]
    return torch.stack([(y.abs() * gy.abs()).sum(-1) for y in ys], dim=-1)


def _check(got, want, dtype, what, inputs=None, kw=None):
    """Every result within its bound of the float64 reference; the routing weights' gradient
    against the magnitudes of its terms (from inputs and kw, the call's)."""
    for name, o, r in zip(RESULTS, got, want):
        if r is None:
            assert o is None, (what, name)
            continue
        assert o.shape == r.shape, (what, name, o.shape, r.shape)
        low = max(dtype, o.dtype, key=lambda t: MOE_REL_TOL[t])  # float32 weights of bfloat16 x
        if name == "grad_top_k_weights":
            tol = MOE_WEIGHTS_COND_TOL[low]
            e = scaled_err(o, r, _weights_grad_scale(inputs, kw))
        else:
            tol = MOE_REL_TOL[low]
            e = rel_err(o.cpu(), r)
        measured(f"moe/{str(low)[6:]}/{name}", e)
        assert e <= tol, f"{what} {dtype} {name}: err {e:.3g} > {tol:.1g}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", range(len(SHAPES)))
def test_matches_reference(layout, dtype, case, poison, seed):
    lead, h, i, e, k, bias, used = SHAPES[case]
    inputs = moe_inputs(lead, h, i, e, k, dtype, layout, bias=bias, seed=seed, experts_used=used)
    kw = dict(activation="silu", layout=layout)
    got = moe_grads(*inputs, **kw)
    assert got[0].shape == (*lead, h) and got[0].dtype == dtype
    assert got[2].dtype == dtype and got[3].is_contiguous()
    _check(got, moe_ref_grads(*inputs, **kw), dtype, f"{layout} case {case}", inputs, kw)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("layout", ["concatenated", "interleaved_transposed", "ungated"])
def test_every_activation(act, layout, seed):
    inputs = moe_inputs((9,), 10, 7, 4, 2, torch.float64, layout, seed=seed)
    kw = dict(activation=act, layout=layout)
    _check(moe_grads(*inputs, **kw), moe_ref_grads(*inputs, **kw), torch.float64, act, inputs,
           kw)


@pytest.mark.parametrize("layout", GATED)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_clamped_gate_and_up_offset(layout, dtype, seed):
    # gpt-oss's gated product, min(g, L)·σ(1.702·min(g, L))·(clamp(u, −L, L) + 1), with inputs
    # scaled so that a third of the gate and up values lie beyond the limit on either side.
    inputs = list(moe_inputs((17,), 8, 6, 4, 2, dtype, layout, seed=seed))
    inputs[3] = inputs[3] * 4
    kw = dict(activation="quick_gelu", layout=layout, limit=1.5, up_offset=1.0)
    got = moe_grads(*inputs, **kw)
    _check(got, moe_ref_grads(*inputs, **kw), dtype, layout, inputs, kw)
    x, idx, _, gate_up = inputs[:4]
    z = torch.einsum("th,eoh->teo", x.double(), (gate_up.transpose(1, 2) if "transposed" in layout
                                                  else gate_up).double())
    assert (z > 1.5).float().mean() > 0.1 and (z < -1.5).float().mean() > 0.1
    plain = moe_grads(*inputs, activation="quick_gelu", layout=layout)
    assert rel_err(plain[0], got[0]) > 1e-3  # the clamps change the result


def test_pairs_routed_to_no_expert_add_nothing():
    # The index E (transformers' expert-parallel sentinel) drops a pair: no contribution, a zero
    # gradient for its weight.
    inputs = list(moe_inputs((6,), 5, 4, 3, 2, torch.float64, seed=3))
    idx = inputs[1].clone()
    idx[1, 0] = idx[4, 1] = 3
    idx[2] = 3
    inputs[1] = idx
    kw = dict(activation="silu", layout="concatenated")
    got = moe_grads(*inputs, **kw)
    _check(got, moe_ref_grads(*inputs, **kw), torch.float64, "dropped", inputs, kw)
    assert got[2][1, 0] == 0 and got[2][4, 1] == 0 and (got[2][2] == 0).all()
    assert (got[0][2] == 0).all() and (got[1][2] == 0).all()


def test_weights_of_another_dtype():
    # float32 routing weights with float64 or bfloat16 x, as transformers' routers give them:
    # the weighted sum in the promoted dtype, y in x's dtype, the weights' gradient in theirs.
    for dtype in (torch.float64, torch.bfloat16):
        inputs = list(moe_inputs((11,), 6, 5, 4, 2, dtype, seed=5))
        inputs[2] = inputs[2].float()
        kw = dict(activation="silu", layout="concatenated")
        got = moe_grads(*inputs, **kw)
        assert got[0].dtype == dtype and got[2].dtype == torch.float32
        _check(got, moe_ref_grads(*inputs, **kw), dtype, "float32 weights", inputs, kw)


def test_layouts_of_the_same_experts_agree_and_strided_inputs_are_read():
    # The same experts stored as each gated layout (each stored form a view of one tensor: padded
    # x rows, transposed and interleaved weights) give the same output within LAYOUT_REL_TOL, and
    # int32 indices the same as int64. Not bitwise: each layout is a GEMM on other operand
    # layouts, which MKL may run with other kernels (docs/testing.md, "Bitwise or within a bound").
    x, idx, w, gu, d, gub, db, gy = moe_inputs((13,), 6, 5, 4, 2, torch.float32, seed=21)
    E, I = 4, 5
    inter = lambda t: t.view(E, 2, I, *t.shape[2:]).transpose(1, 2).reshape(t.shape)
    forms = {"concatenated": (gu, d, gub), "interleaved": (inter(gu), d, inter(gub)),
             "concatenated_transposed": (gu.transpose(1, 2), d.transpose(1, 2), gub),
             "interleaved_transposed": (inter(gu).transpose(1, 2), d.transpose(1, 2), inter(gub))}
    xp = torch.zeros(13, 9)[:, :6].copy_(x)
    outs = {name: ckpt_ext.moe_experts(xp, idx.int(), w, g, dn, gate_up_bias=b, down_bias=db,
                                       activation="silu", layout=name)
            for name, (g, dn, b) in forms.items()}
    want = ckpt_ext.moe_experts(x, idx, w, gu, d, gate_up_bias=gub, down_bias=db,
                                activation="silu")
    for name, y in outs.items():
        assert measured("moe_layouts/out", rel_err(y, want)) <= LAYOUT_REL_TOL, name
    # the gradient of a stored view reaches its base
    base = gu.clone().requires_grad_()
    y = ckpt_ext.moe_experts(x, idx, w, base.transpose(1, 2), d.transpose(1, 2),
                             activation="silu", layout="concatenated_transposed")
    (g_view,) = torch.autograd.grad(y, base, gy)
    (g_direct,) = torch.autograd.grad(
        ckpt_ext.moe_experts(x, idx, w, base, d, activation="silu"), base, gy)
    assert measured("moe_layouts/grad_gate_up", rel_err(g_view, g_direct)) <= LAYOUT_REL_TOL


def test_forward_is_deterministic_and_the_recompute_is_the_forwards():
    # Two calls give the same bits; the down weight's gradient from the recomputed h equals
    # dyᵀ·h with h from a forward whose down projection is the identity (one expert, weight 1).
    inputs = moe_inputs((20,), 7, 9, 1, 1, torch.float32, seed=7)
    x, idx, w, gu, d = inputs[:5]
    w = torch.ones_like(w)
    f = lambda dn: ckpt_ext.moe_experts(x, idx, w, gu, dn, activation="gelu")
    assert torch.equal(f(d), f(d))
    dn = d.clone().requires_grad_()
    gy = torch.randn(20, 7)
    (gd,) = torch.autograd.grad(f(dn), dn, gy)
    h = ckpt_ext.moe_experts(x, idx, w, gu, torch.eye(9)[None], activation="gelu")
    assert torch.equal(gd[0], gy.t() @ h)


# ---- gradients -----------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradcheck(layout):
    x, idx, w, gu, d, gub, db, _ = moe_inputs((5,), 3, 4, 3, 2, torch.float64, layout, seed=5)
    kw = dict(activation="silu", layout=layout)
    if layout in GATED:
        kw.update(limit=2.5, up_offset=0.5)
    f = lambda x, w, gu, d, gub, db: ckpt_ext.moe_experts(x, idx, w, gu, d, gate_up_bias=gub,
                                                          down_bias=db, **kw)
    args = tuple(t.requires_grad_() for t in (x, w, gu, d, gub, db))
    assert torch.autograd.gradcheck(f, args)
    if layout in ("concatenated", "interleaved_transposed", "ungated"):
        assert torch.autograd.gradgradcheck(f, args)


@pytest.mark.parametrize("create_graph", [False, True])
def test_each_gradient_alone_and_frozen_parameters(create_graph):
    # Each tensor's gradient asked alone equals the one from a call asking for all; the others,
    # frozen, get none, and the backward runs only the GEMMs the one asked for needs (its FLOPs,
    # counted on the C++ backward: gu = the gate_up GEMM, dn = the down GEMM over the routed rows).
    from torch.utils.flop_counter import FlopCounterMode
    T, H, I, K = 8, 5, 6, 2
    inputs = moe_inputs((T,), H, I, 4, K, torch.float64, "concatenated_transposed", seed=11)
    kw = dict(activation="silu", layout="concatenated_transposed")
    want = moe_grads(*inputs, **kw)
    x, idx, w, gu, d, gub, db, gy = inputs
    gemm_gu, gemm_dn = 2 * T * K * 2 * I * H, 2 * T * K * I * H
    flops = [2 * gemm_gu + gemm_dn, gemm_gu + gemm_dn, 2 * gemm_gu + gemm_dn, gemm_gu + gemm_dn,
             gemm_gu + gemm_dn, 0]  # x, top_k_weights, gate_up, down, gate_up_bias, down_bias
    params = [x, w, gu, d, gub, db]
    for i in range(len(params)):
        leaves = [t.detach().requires_grad_(j == i) for j, t in enumerate(params)]
        out = ckpt_ext.moe_experts(leaves[0], idx, leaves[1], leaves[2], leaves[3],
                                   gate_up_bias=leaves[4], down_bias=leaves[5], **kw)
        with FlopCounterMode(display=False) as count:
            (got,) = torch.autograd.grad(out, leaves[i], gy, create_graph=create_graph)
        assert rel_err(got, want[1 + i]) <= 1e-14, RESULTS[1 + i]
        assert all(t.grad is None for t in leaves)
        if not create_graph:
            assert count.get_total_flops() == flops[i], RESULTS[1 + i]


def test_torch_func_grad_and_second_order():
    from torch.func import grad
    inputs = moe_inputs((6,), 4, 5, 3, 2, torch.float64, "interleaved", seed=9)
    x, idx, w, gu, d, gub, db, _ = inputs
    kw = dict(activation="gelu_tanh", layout="interleaved", limit=3.0, up_offset=1.0)

    def loss(fn):
        return lambda x, w, gu, d: (fn(x, idx, w, gu, d, gub, db) ** 2).sum()

    fused = loss(lambda *a: ckpt_ext.moe_experts(*a[:5], gate_up_bias=a[5], down_bias=a[6],
                                                 **kw))
    ref = loss(lambda *a: moe_ref(*a, kw["activation"], kw["layout"], kw["limit"],
                                  kw["up_offset"]))
    for got, want in zip(grad(fused, argnums=(0, 1, 2, 3))(x, w, gu, d),
                         grad(ref, argnums=(0, 1, 2, 3))(x, w, gu, d)):
        assert rel_err(got, want) <= 1e-13
    second = lambda f: grad(lambda x: grad(f)(x, w, gu, d).sin().sum())(x)
    assert rel_err(second(fused), second(ref)) <= 1e-12


@pytest.mark.parametrize("layout", ["concatenated", "interleaved_transposed"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph(layout, dynamic):
    torch._dynamo.reset()
    x, idx, w, gu, d, gub, db, gy = moe_inputs((12,), 6, 5, 4, 2, torch.float32, layout, seed=13)
    f = lambda x, w, gu, d, gub, db: ckpt_ext.moe_experts(
        x, idx, w, gu, d, gate_up_bias=gub, down_bias=db, activation="silu", layout=layout)
    cf = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    args = [t.requires_grad_() for t in (x, w, gu, d, gub, db)]
    y, yc = f(*args), cf(*args)
    assert torch.equal(yc, y)
    for a, b in zip(torch.autograd.grad(y, args, gy), torch.autograd.grad(yc, args, gy)):
        assert torch.equal(b, a)


def test_autocast_bfloat16():
    x, idx, w, gu, d, gub, db, gy = moe_inputs((16,), 8, 12, 4, 2, torch.float32, seed=13)
    params = [t.requires_grad_() for t in (gu, d, gub, db)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ckpt_ext.moe_experts(x, idx, w, gu, d, gate_up_bias=gub, down_bias=db,
                                 activation="silu")
    assert y.dtype == torch.bfloat16
    b = lambda t: t.detach().bfloat16().double()
    want = moe_ref(b(x), idx, w.double(), b(gu), b(d), b(gub), b(db), "silu", "concatenated")
    assert rel_err(y, want) <= MOE_REL_TOL[torch.bfloat16]
    y.float().backward(gy)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in params)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_opcheck(layout):
    x, idx, w, gu, d, gub, db, gy = moe_inputs((6,), 3, 5, 4, 2, torch.float64, layout,
                                               bias=(True, False), seed=15)
    gated = layout in GATED
    spec = ("silu", layout, 2.0 if gated else None, 1.0 if gated else 0.0)
    torch.library.opcheck(torch.ops.ckpt_ext.moe_experts.default,
                          (x.requires_grad_(), idx, w.requires_grad_(), gu.requires_grad_(),
                           d.requires_grad_(), gub.requires_grad_(), None, *spec))
    torch.library.opcheck(
        torch.ops.ckpt_ext.moe_experts_backward.default,
        (gy, x.detach(), idx, w.detach(), gu.detach(), d.detach(), gub.detach(), None, *spec,
         [True] * 6),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


# ---- cost ----------------------------------------------------------------------------------------

def test_flops_count_routed_rows_only():
    from torch.utils.flop_counter import FlopCounterMode
    T, H, I, K = 10, 4, 6, 2

    def count(experts):
        x, idx, w, gu, d, _, _, gy = moe_inputs((T,), H, I, experts, K, torch.float32,
                                                bias=(False, False), seed=1)
        leaves = [t.requires_grad_() for t in (x, w, gu, d)]
        with FlopCounterMode(display=False) as c:
            ckpt_ext.moe_experts(x, idx, w, gu, d, activation="silu").backward(gy)
        return c.get_total_flops()

    gate_up, down = 2 * T * K * 2 * I * H, 2 * T * K * H * I
    forward = gate_up + down
    # backward: the recompute of gate_up, g0 and grad_down, grad_gate_up and grad_x
    backward = gate_up + 2 * down + 2 * gate_up
    assert count(4) == count(64) == forward + backward


def test_experts_without_tokens_run_no_gemm():
    # 33 tokens on experts 1 and 5 of 8: the forward runs two GEMMs for each of those and none
    # for the six others (no Python loop either: the loop over experts is in C++).
    x, idx, w, gu, d, _, _, _ = moe_inputs((33,), 6, 5, 8, 2, torch.float32, bias=(False, False),
                                           experts_used=[1, 5], seed=2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ckpt_ext.moe_experts(x, idx, w, gu, d, activation="silu")
    names = [e.name for e in prof.events()]
    assert names.count("aten::mm") + names.count("aten::addmm") == 4, sorted(set(names))


# ---- transformers' experts modules ---------------------------------------------------------------

def _families():
    """(name, experts class, tiny config, how ckpt_ext.moe_experts reads the module)."""
    from transformers import (DeepseekV3Config, GptOssConfig, MixtralConfig, NemotronHConfig,
                              OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts
    from transformers.models.olmoe.modeling_olmoe import OlmoeExperts
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    H, I, E, K = 16, 24, 4, 2
    return {
        "mixtral": (MixtralExperts, MixtralConfig(hidden_size=H, intermediate_size=I,
                                                  num_local_experts=E, num_experts_per_tok=K)),
        "qwen3_moe": (Qwen3MoeExperts, Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I,
                                                      num_experts=E, num_experts_per_tok=K)),
        "qwen2_moe": (Qwen2MoeExperts, Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=I,
                                                      num_experts=E, num_experts_per_tok=K)),
        "deepseek_v3": (DeepseekV3Experts, DeepseekV3Config(
            hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K)),
        "olmoe": (OlmoeExperts, OlmoeConfig(hidden_size=H, intermediate_size=I, num_experts=E,
                                            num_experts_per_tok=K)),
        "gpt_oss": (GptOssExperts, GptOssConfig(hidden_size=H, intermediate_size=I,
                                                num_local_experts=E, num_experts_per_tok=K)),
        # ungated experts; relu instead of the family's relu2, which is no registry row
        "nemotron_h": (NemotronHExperts, NemotronHConfig(
            hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K,
            mlp_hidden_act="relu")),
    }


def moe_arguments(m):
    """((gate_up, down, gate_up_bias, down_bias), keywords) of ckpt_ext.moe_experts for a
    transformers experts module: its own parameters, the layout from its
    use_experts_implementation flags, the activation from its act_fn (a registry form), and
    gpt-oss's _apply_gate as quick_gelu (its alpha is QuickGELU's 1.702) with its limit and
    up_offset 1."""
    from ckpt_ext._activations import REGISTRY
    from transformers.integrations.moe import _default_apply_gate
    params = (m.gate_up_proj if m.has_gate else m.up_proj, m.down_proj,
              (m.gate_up_proj_bias if m.has_gate else m.up_proj_bias) if m.has_bias else None,
              m.down_proj_bias if m.has_bias else None)
    kw = dict(layout=ckpt_ext.moe_layout(gated=m.has_gate, interleaved=not m.is_concatenated,
                                         transposed=m.is_transposed))
    if m.has_gate and type(m)._apply_gate is not _default_apply_gate:
        assert type(m).__name__ == "GptOssExperts" and m.alpha == 1.702
        kw.update(activation="quick_gelu", limit=m.limit, up_offset=1.0)
    else:
        act = m.act_fn
        named = lambda form: form.cls if isinstance(form.cls, str) else form.cls.__name__
        kw.update(activation=next(r.name for r in REGISTRY.values() for form in r.modules
                                  if named(form) == type(act).__name__ and form.accepts(act)))
    return params, kw


def moe_call(m, x, top_k_index, top_k_weights):
    """ckpt_ext.moe_experts computing what the experts module m computes."""
    (gate_up, down, gate_up_bias, down_bias), kw = moe_arguments(m)
    return ckpt_ext.moe_experts(x, top_k_index, top_k_weights, gate_up, down,
                                gate_up_bias=gate_up_bias, down_bias=down_bias, **kw)


def _module_and_routing(family, impl, dtype, tokens, seed):
    cls, config = _families()[family]
    config._experts_implementation = impl
    m = cls(config).to(dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if "bias" in name else 0.2))
    x = torch.randn(tokens, config.hidden_size, generator=g).to(dtype) * 2
    # a router's output: float32 softmax probabilities of the top-2 (transformers' routers)
    logits = torch.randn(tokens, m.num_experts, generator=g)
    w, idx = logits.softmax(-1).topk(2, dim=-1)
    if family == "nemotron_h":
        w = w.to(dtype)  # its eager forward sums in the weights' dtype (float64 x via float32)
    return m, x, idx, w


# Against the module in its dtype, every result but the routing weights' gradient, relative, and
# that one against the magnitudes of its terms (as _check; relative, it measured up to 1.8e-15 in
# float64, 6.5e-06 in float32): float64 within 1e-14 (the largest measured over seeds 0-29,
# every family and implementation: 7.3e-16, the weights' 2.0e-16); float32 ~5x the largest
# measured, 5.2e-07 (the weights' 2.3e-07).
MODULE_TOL = {torch.float64: 1e-14, torch.float32: 3e-6}
MODULE_WEIGHTS_COND_TOL = {torch.float64: 1e-14, torch.float32: 1e-6}


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "olmoe",
                                    "gpt_oss", "nemotron_h"])
@pytest.mark.parametrize("impl", ["eager", "batched_mm", "grouped_mm"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("tokens", [1, 9])
def test_matches_transformers_experts(family, impl, dtype, tokens, seed):
    # One token leaves two of four experts without tokens. Outputs and every gradient.
    m, x, idx, w = _module_and_routing(family, impl, dtype, tokens, seed)
    params, kw = moe_arguments(m)
    leaves = [x.requires_grad_(), w.requires_grad_(), *(p for p in params if p is not None)]
    gy = torch.randn(x.shape, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            want_y = m(x, idx, w)
        except RuntimeError as e:  # grouped_mm: torch._grouped_mm takes no float64 on the CPU
            pytest.skip(f"transformers' {impl} does not run {dtype} on the CPU: {e}")
    want = torch.autograd.grad(want_y, leaves, gy)
    got_y = moe_call(m, x, idx, w)
    got = torch.autograd.grad(got_y, leaves, gy)
    for name, a, b in zip(RESULTS, [got_y, *got], [want_y, *want]):
        assert a.dtype == b.dtype, name
        if name == "grad_top_k_weights":
            tol = MODULE_WEIGHTS_COND_TOL[dtype]
            e = scaled_err(a, b, _weights_grad_scale((x, idx, w, *params, gy), kw))
        else:
            tol, e = MODULE_TOL[dtype], rel_err(a, b)
        measured(f"moe/module/{str(dtype)[6:]}/{name}", e)
        assert e <= tol, f"{family} {impl} {name}: err {e:.3g}"


def test_gpt_oss_clamps_engage_against_the_module():
    # gpt-oss with gate and up values beyond its limit (7): still the module's result.
    m, x, idx, w = _module_and_routing("gpt_oss", "eager", torch.float64, 9, 0)
    x = x * 20
    with torch.no_grad():
        z = torch.einsum("th,eho->teo", x, m.gate_up_proj) + m.gate_up_proj_bias
    assert (z > 7).any() and (z < -7).any()
    assert rel_err(moe_call(m, x, idx, w), m(x, idx, w)) <= 1e-14


def test_keeps_x_and_the_routing_only():
    # Saved-tensor hooks: the op saves x, top_k_index and top_k_weights (and the parameters);
    # transformers' experts module keeps every expert's gathered rows and its gate, up, f(gate)
    # and h, several times x and the routing, in each implementation. The exact CPU meter: the op
    # keeps no byte beyond its inputs, and its backward peaks no higher than the module's.
    m, x, idx, w = _module_and_routing("mixtral", "eager", torch.float32, 64, 0)
    x, w = x.requires_grad_(), w.requires_grad_()
    routing = x.nbytes + idx.nbytes + w.nbytes
    assert saved_activation_bytes(m, x, idx, w, run=lambda *a: moe_call(m, *a)) == routing
    gy = torch.randn_like(x)
    leaves = [x, w, *m.parameters()]
    fused = lambda: moe_call(m, x, idx, w)
    for impl in ("eager", "batched_mm", "grouped_mm"):
        m.config._experts_implementation = impl
        stock = saved_activation_bytes(m, x, idx, w)
        assert stock >= routing + 3 * 64 * 2 * 24 * 4, (impl, stock)  # f(g), u, h per pair
        kept, peak = kept_and_peak((("fused", fused), (impl, lambda: m(x, idx, w))), leaves, gy)
        assert kept["fused"] == 0 and kept[impl] > 0, kept
        assert peak["fused"] <= peak[impl], peak


# ---- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_errors_name_expected_and_given(device):
    x, idx, w, gu, d, gub, db, _ = moe_inputs((5,), 4, 3, 2, 2, torch.float32)
    x, w, gu, d, gub, db = (t.to(device) for t in (x, w, gu, d, gub, db))
    idx = idx.to(device)
    call = lambda **kw: ckpt_ext.moe_experts(**{**dict(
        x=x, top_k_index=idx, top_k_weights=w, gate_up=gu, down=d, activation="silu"), **kw})
    cases = [
        (ValueError, r"layout must be one of \"concatenated\", .*; got \"stacked\"",
         dict(layout="stacked")),
        (ValueError, r"activation must be one of .*got 'swish'", dict(activation="swish")),
        (TypeError, r"top_k_index must be int64 or int32 \(expert indices\), got Float",
         dict(top_k_index=w)),
        (ValueError, r"top_k_index must have shape x.shape\[:-1\] \+ \(top_k,\) = \[5\] \+ "
                     r"\(top_k,\), got shape \[4, 2\]",
         dict(top_k_index=idx[:4], top_k_weights=w[:4])),
        (ValueError, r"top_k_weights must have the shape of top_k_index \[5, 2\], got shape "
                     r"\[5, 1\]", dict(top_k_weights=w[:, :1])),
        (ValueError, r"gate_up \(num_experts, 2·intermediate, hidden\) must have hidden = "
                     r"x.shape\[-1\] = 3", dict(x=x[:, :3])),
        (ValueError, r"gate_up \(num_experts, hidden, 2·intermediate\) must have hidden = "
                     r"x.shape\[-1\] = 4, got gate_up of shape \[2, 6, 4\]",
         dict(layout="concatenated_transposed")),
        (ValueError, r"gate_up .* must have an even number of outputs", dict(gate_up=gu[:, :5])),
        (ValueError, r"down must be 3-D \(num_experts, out, intermediate\) with num_experts = 2 "
                     r"and intermediate = 3 .*got shape \[2, 4, 2\]", dict(down=d[:, :, :2])),
        (ValueError, r"down must be 3-D .* with num_experts = 2 and intermediate = 6 .*got "
                     r"shape \[2, 4, 3\]", dict(layout="ungated")),
        (ValueError, r"gate_up_bias must have shape \[2, 6\] \(num_experts, gate_up's outputs\), "
                     r"got shape \[2, 5\]", dict(gate_up_bias=gub[:, :5])),
        (ValueError, r"down_bias must have shape \[2, 4\] \(num_experts, out\), got shape "
                     r"\[4\]", dict(down_bias=db[0])),
        (ValueError, r"limit must be a number > 0 \(or None: no clamp\), got -1",
         dict(limit=-1.0)),
        (ValueError, r"limit clamps the gate and up projections, so it needs a gated layout",
         dict(layout="ungated", gate_up=gu[:, :3], limit=7.0)),
        (TypeError, r"down must have the dtype of x \(Float\), got Double", dict(down=d.double())),
        (TypeError, r"top_k_weights must be float32, float64, bfloat16 or float16, got Int",
         dict(top_k_weights=w.int())),
        (TypeError, r"x must be float32, float64, bfloat16 or float16, got Int",
         dict(x=x.int(), gate_up=gu.int(), down=d.int())),
        (TypeError, r"layout must be a str, one of 'concatenated', .*; got int", dict(layout=1)),
    ]
    for exc, msg, kw in cases:
        with pytest.raises(exc, match=msg):
            call(**kw)


def test_out_of_range_index_is_an_error():
    x, idx, w, gu, d, _, _, _ = moe_inputs((5,), 4, 3, 2, 2, torch.float32)
    for bad in (-1, 3):
        i = idx.clone()
        i[2, 1] = bad
        with pytest.raises(ValueError, match=r"top_k_index must hold expert indices in \[0, 2\] "
                           rf"\(2 experts; the index 2 routes a pair to no expert\), got values "
                           rf"from {min(bad, 0)} to {max(bad, 1)}"):
            ckpt_ext.moe_experts(x, i, w, gu, d, activation="silu")


def test_moe_layout_maps_transformers_flags():
    assert ckpt_ext.moe_layout() == "concatenated"
    assert ckpt_ext.moe_layout(interleaved=True, transposed=True) == "interleaved_transposed"
    assert ckpt_ext.moe_layout(gated=False) == "ungated"
    with pytest.raises(ValueError, match="an ungated layout has no gate to interleave"):
        ckpt_ext.moe_layout(gated=False, interleaved=True)


# ---- CUDA (scripts/gpu_check.sh runs the `cuda`-marked tests) ------------------------------------

@pytest.mark.cuda
@requires_gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [1, 3, 5, 6])
def test_cuda_matches_reference_and_the_cpu(layout, dtype, case, poison):
    lead, h, i, e, k, bias, used = SHAPES[case]
    inputs = moe_inputs(lead, h, i, e, k, dtype, layout, bias=bias, device="cuda", seed=19,
                        experts_used=used)
    kw = dict(activation="silu", layout=layout)
    if layout in GATED:
        kw.update(limit=1.0, up_offset=1.0)
    got = moe_grads(*inputs, **kw)
    _check(got, moe_ref_grads(*inputs, **kw), dtype, f"cuda {layout} case {case}", inputs, kw)
    cpu = moe_grads(*(None if t is None else t.cpu() for t in inputs), **kw)
    for name, a, b in zip(RESULTS, got, cpu):
        if b is not None and dtype == torch.float64:
            assert rel_err(a.cpu(), b) <= 1e-14, name

"""transformers' ``Conv1D`` (x·W + b, W stored (in, out): GPT-2's projections) as a Linear of a
run: the ops take a weight in either layout (no copy, no transpose per step) and give its gradient
that layout; GPT-2's ``c_fc -> gelu_new -> c_proj`` is one unit per layer, exact against an
unfused copy in float64 (train with dropout, and eval), its MLP's kept bytes freed, and
``generate``, ``save_pretrained`` and ``unfuse`` as on the unfused model."""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

import ckpt_ext
from ckpt_ext import fuse, unfuse
from ckpt_ext.convert import RunMember
from _ecosys import assert_same_greedy_tokens, saved_activation_bytes

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from transformers.pytorch_utils import Conv1D  # noqa: E402

E, V = 16, 50
# The fused MLPs' logits against the unfused model's: measured 0 here; the same plain model's
# logits under other MKL/oneDNN/ATen kernels (make test-dispatch's variables) move by up to
# 1.3e-7 relative, so a bound of ~8x that.
GENERATE_TOL = 1e-6


def _stored(k, n, gen):
    """A Conv1D's weight: (in, out), contiguous; the ops get its (out, in) transpose, a view."""
    return torch.randn(k, n, dtype=torch.float64, generator=gen).requires_grad_()


def _reference(x, ws, bs, act):
    h = x
    for i, (w, b) in enumerate(zip(ws, bs)):
        h = torch.addmm(b, h.reshape(-1, h.shape[-1]), w).view(*h.shape[:-1], w.shape[1])
        if i < len(ws) - 1:
            h = act(h)
    return h


@pytest.mark.parametrize("activation,act", [("gelu_tanh", lambda z: F.gelu(z, approximate="tanh")),
                                            ("tanh", torch.tanh), ("relu", torch.relu)])
def test_mlp_takes_a_transposed_weight_and_gives_its_gradient_that_layout(activation, act):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 7, dtype=torch.float64, generator=gen).requires_grad_()
    ws = [_stored(7, 13, gen), _stored(13, 6, gen)]
    bs = [torch.randn(13, dtype=torch.float64, generator=gen).requires_grad_(),
          torch.randn(6, dtype=torch.float64, generator=gen).requires_grad_()]
    out = ckpt_ext.mlp(x, [w.t() for w in ws], bs, activation=activation, last_activation=False)
    ref = _reference(x, ws, bs, act)
    torch.testing.assert_close(out, ref, rtol=1e-14, atol=1e-14)
    g = torch.randn(ref.shape, dtype=torch.float64, generator=gen)
    got = torch.autograd.grad(out, [x, *ws, *bs], g)
    want = torch.autograd.grad(ref, [x, *ws, *bs], g)
    for name, a, b in zip(["x", "w0", "w1", "b0", "b1"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13, msg=name)
    # the stored (in, out) tensor's gradient is contiguous: made in its layout, not copied
    assert all(gw.is_contiguous() for gw in got[1:3])


def test_backward_op_gives_each_weight_gradient_its_weights_layout():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, dtype=torch.float64, generator=gen)
    w0 = torch.randn(6, 9, dtype=torch.float64, generator=gen).t()  # transposed: (9, 6)
    w1 = torch.randn(5, 9, dtype=torch.float64, generator=gen)      # row-major: (5, 9)
    grad_out = torch.randn(4, 5, dtype=torch.float64, generator=gen)
    _, gws, _ = torch.ops.ckpt_ext.mlp_backward(grad_out, x, [w0, w1], [], [False, False],
                                                "tanh", False, True, [True, True], [])
    assert gws[0].shape == w0.shape and gws[0].stride() == w0.stride()
    assert gws[1].shape == w1.shape and gws[1].is_contiguous()
    w0r = w0.detach().requires_grad_()
    ref0 = torch.autograd.grad(F.linear(torch.tanh(F.linear(x, w0r)), w1), w0r, grad_out)[0]
    torch.testing.assert_close(gws[0], ref0, rtol=1e-13, atol=1e-13)


def test_opcheck_with_transposed_weights():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    ws = [torch.randn(4, 8, dtype=torch.float64, generator=gen).t().requires_grad_(),
          torch.randn(8, 3, dtype=torch.float64, generator=gen).t().requires_grad_()]
    bs = [torch.randn(8, dtype=torch.float64, generator=gen, requires_grad=True)]
    torch.library.opcheck(torch.ops.ckpt_ext.mlp.default,
                          (x, ws, bs, [True, False], "gelu_tanh", False))
    gated = [torch.randn(4, 6, dtype=torch.float64, generator=gen).t().requires_grad_()
             for _ in range(2)] + [torch.randn(6, 4, dtype=torch.float64,
                                               generator=gen).t().requires_grad_()]
    torch.library.opcheck(torch.ops.ckpt_ext.gated_mlp.default,
                          (x, gated, [], [False, False, False], "silu"))


def test_linear_tanh_and_gated_mlp_take_transposed_weights():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    w = _stored(4, 7, gen)
    b = torch.randn(7, dtype=torch.float64, generator=gen, requires_grad=True)
    out = ckpt_ext.linear_tanh(x, w.t(), b)
    ref = torch.tanh(torch.addmm(b, x, w))
    torch.testing.assert_close(out, ref, rtol=1e-14, atol=1e-14)
    got, want = (torch.autograd.grad(o.sum(), [x, w, b]) for o in (out, ref))
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, rtol=1e-13, atol=1e-13)
    assert got[1].is_contiguous()
    gate, up, down = _stored(4, 6, gen), _stored(4, 6, gen), _stored(6, 4, gen)
    out = ckpt_ext.gated_mlp(x, gate.t(), up.t(), down.t(), activation="silu")
    ref = (F.silu(x @ gate) * (x @ up)) @ down
    torch.testing.assert_close(out, ref, rtol=1e-14, atol=1e-14)
    got, want = (torch.autograd.grad(o.sum(), [x, gate, up, down]) for o in (out, ref))
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, rtol=1e-13, atol=1e-13)
    assert all(g.is_contiguous() for g in got[1:])


# -- GPT-2 -----------------------------------------------------------------------------------------

def _gpt2(pdrop=0.1):
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_positions=32, n_embd=E, n_layer=2, n_head=2, resid_pdrop=pdrop,
        embd_pdrop=pdrop, attn_pdrop=pdrop))


def _compare(plain, fused, ids, train):
    plain.train(train)
    fused.train(train)
    torch.manual_seed(1)  # the same Dropout masks
    a = plain(ids).logits
    torch.manual_seed(1)
    b = fused(ids).logits
    scale = a.abs().max()
    assert (a - b).abs().max() <= 1e-14 * scale, f"logits, train={train}"
    ga = torch.autograd.grad(a.square().sum(), list(plain.parameters()))
    gb = torch.autograd.grad(b.square().sum(), list(fused.parameters()))
    gscale = max(g.abs().max() for g in ga)
    for (name, p), x, y in zip(fused.named_parameters(), ga, gb):
        assert y.shape == p.shape and y.stride() == p.stride(), name
        err = (y - x).abs().max() / gscale
        assert err <= 1e-13, f"grad of {name}, train={train}: {err:.3g}"


def test_gpt2_mlp_is_one_unit_per_layer_and_exact():
    plain = _gpt2().double()
    fused = copy.deepcopy(plain)
    _, report = fuse(fused)
    units = [d for d in report.fused if "c_fc" in d.layers[0]]
    assert len(units) == 2, str(report)
    for d, block in zip(units, fused.transformer.h):
        assert [lay.rsplit(".", 1)[-1] for lay in d.layers] == ["c_fc", "act", "c_proj"], d
        assert d.bytes_per_row > 0
    assert not any(".mlp." in p for p, _ in report.other_layers), report
    mlp = fused.transformer.h[0].mlp
    assert isinstance(mlp.c_fc, Conv1D) and isinstance(mlp.c_fc, RunMember)
    assert type(mlp.c_fc).__name__ == "RunConv1D"
    ids = torch.randint(0, V, (2, 9))
    for train in (True, False):
        _compare(plain, fused, ids, train)


def test_gpt2_weight_gradient_lands_in_the_stored_layout():
    fused = _gpt2(0.0)
    fuse(fused)
    fused(torch.randint(0, V, (2, 9))).logits.sum().backward()
    for block in fused.transformer.h:
        for conv in (block.mlp.c_fc, block.mlp.c_proj):
            w = conv.weight
            assert w.grad.shape == w.shape and w.grad.is_contiguous()


def test_gpt2_mlp_kept_bytes_are_freed():
    """float32 training step: what autograd keeps drops by every byte the MLPs keep beyond
    their input (c_fc's output and gelu_new's intermediates), measured per MLP."""
    plain = _gpt2(0.0)
    fused = copy.deepcopy(plain)
    fuse(fused)
    ids = torch.randint(0, V, (3, 7))
    mlp_kept = 0
    for block in plain.transformer.h:
        x = torch.randn(3, 7, E, requires_grad=True)
        mlp_kept += saved_activation_bytes(block.mlp, x) - x.numel() * 4  # less its input
    drop = saved_activation_bytes(plain, ids) - saved_activation_bytes(fused, ids)
    assert mlp_kept > 0 and drop >= 0.9 * mlp_kept, (drop, mlp_kept)


def test_gpt2_generate_save_and_unfuse(tmp_path):
    plain = _gpt2().eval()
    fused = copy.deepcopy(plain)
    fuse(fused)
    ids = torch.randint(1, V, (1, 4))
    # float32 logits within GENERATE_TOL of the unfused model's (not bitwise: other kernels)
    assert_same_greedy_tokens(plain, fused, ids, GENERATE_TOL, "fuse.conv1d.generate",
                              max_new_tokens=6, pad_token_id=0)
    fused.save_pretrained(tmp_path)
    saved = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    for (name, p), (_, q) in zip(plain.state_dict().items(), saved.state_dict().items()):
        assert p.shape == q.shape and torch.equal(p, q), name
    assert type(saved.transformer.h[0].mlp.c_fc) is Conv1D
    unfuse(fused)
    for block in fused.transformer.h:
        assert type(block.mlp.c_fc) is Conv1D and type(block.mlp.c_proj) is Conv1D
        assert "forward" not in vars(block.mlp)
    assert torch.equal(plain(ids).logits, fused(ids).logits)


def test_conv1d_with_a_hook_is_left_alone_with_the_reason():
    model = _gpt2(0.0)
    model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda m, i, o: None)
    _, report = fuse(model)
    assert len([d for d in report.fused if "c_fc" in d.layers[0]]) == 1, str(report)
    assert "hooks" in str(report)


class _ConvList(torch.nn.Module):
    """Conv1D layers held in a list, the activation a function call: fused only by a rewrite."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.ModuleList([Conv1D(8, 5), Conv1D(3, 8)])

    def forward(self, x):
        return self.fc[1](torch.tanh(self.fc[0](x)))


def test_conv1d_layers_in_a_rewritten_forward():
    torch.manual_seed(0)
    plain = _ConvList().double()
    fused = copy.deepcopy(plain)
    _, report = fuse(fused, rewrite=True)
    assert [d.how for d in report.fused] == ["rewrite"], str(report)
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    a, b = plain(x), fused(x)
    torch.testing.assert_close(b, a, rtol=1e-14, atol=1e-14)
    ga = torch.autograd.grad(a.sum(), [x, *plain.parameters()])
    gb = torch.autograd.grad(b.sum(), [x, *fused.parameters()])
    for u, v in zip(ga, gb):
        torch.testing.assert_close(v, u, rtol=1e-13, atol=1e-13)
    assert saved_activation_bytes(fused, x) < saved_activation_bytes(plain, x)


def test_gpt2_mlp_under_compile_fullgraph():
    plain = _gpt2(0.0).double().transformer.h[0].mlp
    fused = copy.deepcopy(plain)
    fuse(fused)
    x = torch.randn(2, 5, E, dtype=torch.float64, requires_grad=True)
    a = plain(x)
    b = torch.compile(fused, backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(b, a, rtol=1e-14, atol=1e-14)
    ga = torch.autograd.grad(a.sum(), [x, *plain.parameters()])
    gb = torch.autograd.grad(b.sum(), [x, *fused.parameters()])
    for u, v in zip(ga, gb):
        torch.testing.assert_close(v, u, rtol=1e-13, atol=1e-13)
        assert v.is_contiguous()


def test_transposed_weights_on_each_device(device):
    """float32 on the device (cuda-marked on the GPU): the op with Conv1D-layout weights against
    x·W + b, and each stored weight's gradient contiguous in its (in, out) layout."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(37, 24, generator=gen).to(device).requires_grad_()
    ws = [torch.randn(24, 40, generator=gen).mul_(0.2).to(device).requires_grad_(),
          torch.randn(40, 9, generator=gen).mul_(0.2).to(device).requires_grad_()]
    bs = [torch.randn(40, generator=gen).to(device).requires_grad_(),
          torch.randn(9, generator=gen).to(device).requires_grad_()]
    out = ckpt_ext.mlp(x, [w.t() for w in ws], bs, activation="gelu_tanh", last_activation=False)
    act = lambda z: F.gelu(z, approximate="tanh")  # noqa: E731
    ref = _reference(*(t.double() for t in (x,)), [w.double() for w in ws],
                     [b.double() for b in bs], act)
    # measured on the CPU: 6e-7 of the output's scale, 1.6e-7 of each gradient's
    assert (out.double() - ref).abs().max() <= 5e-6 * ref.abs().max()
    got = torch.autograd.grad(out.square().sum(), [x, *ws, *bs])
    want = torch.autograd.grad(ref.square().sum(), [x, *ws, *bs])
    for a, b in zip(got, want):
        assert (a.double() - b.double()).abs().max() <= 2e-6 * b.abs().max()
    assert got[1].is_contiguous() and got[2].is_contiguous()

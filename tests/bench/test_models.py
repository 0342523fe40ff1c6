"""The benchmark's networks: structure, keys, cross-loading, every mode computing plain's loss and
gradients, what each mode keeps (exact bytes), and the GEMMs each mode recomputes (the benchmark's
floor) against FLOP counts."""
import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import ckpt_ext
from ckpt_ext.models import (ACTIVATION_MODULES, BertMLPNet, LlamaLoRANet, MLPNet, MoENet,
                             NETWORKS, Net, PINNNet, ResidualNet, is_pinn, recomputed_gemms)

IN = {name: 2 if is_pinn(name) else 7 for name in NETWORKS}  # PINNNet takes (t, x) points


#: Networks whose first block's MLP input requires no grad (the token rows; a frozen norm's output
#: of them): reentrant checkpoint would leave that block's parameters without gradients.
NO_REENTRANT = ("bert-mlp", "llama-lora", "llama-lora-dropout")


def _variants(name):
    """(mode, use_reentrant) for every way network ``name`` runs; reentrant checkpoint refuses
    torch.autograd.grad, which the physics-informed loss needs, and NO_REENTRANT refuse it."""
    cls = NETWORKS[name]
    out = [(m, False) for m in cls.MODES if m != "plain"]
    if not is_pinn(name) and name not in NO_REENTRANT:
        out.append(("checkpoint", True))
    return out


def _input(name, n, dtype, seed=0, shape=None):
    gen = torch.Generator().manual_seed(seed)
    if is_pinn(name):
        return PINNNet.points(n, gen, dtype=dtype)
    return torch.randn(*(shape or (n, IN[name])), generator=gen, dtype=dtype)


def _forward(net, x):
    """net(x) with the generator seeded: the LoRA dropout networks draw the same masks in every
    mode."""
    torch.manual_seed(1234)
    return net(x)


def _step(net, x):
    net.zero_grad(set_to_none=True)
    x.grad = None
    loss = type(net).loss(_forward(net, x), x)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in net.named_parameters() if p.requires_grad}


def _rel(a, b):
    return float((a - b).norm() / b.norm())


ALL = [(name, mode, re) for name in NETWORKS for mode, re in _variants(name)]


@pytest.mark.parametrize("name,mode,reentrant", ALL, ids=[f"{n}-{m}{'-re' * r}" for n, m, r in ALL])
def test_modes_match_plain_float64(name, mode, reentrant):
    # Odd sizes, float64, the same weights: the modes differ only in rounding order (measured over
    # 5 seeds: loss 1.0e-17, gradients 4.8e-16 relative; the bounds are 10x that).
    torch.manual_seed(0)
    kw = dict(in_features=IN[name], hidden=13, depth=3, dtype=torch.float64)
    plain = NETWORKS[name](mode="plain", **kw)
    other = NETWORKS[name](mode=mode, use_reentrant=reentrant, **kw)
    other.load_state_dict(plain.state_dict())
    x = _input(name, 40 if is_pinn(name) else 5, torch.float64)
    loss_p, grads_p = _step(plain, x)
    loss_o, grads_o = _step(other, x)
    assert torch.isfinite(loss_o)
    assert abs(float(loss_o - loss_p)) <= 1e-16 * max(1.0, abs(float(loss_p)))
    assert grads_o.keys() == grads_p.keys()
    for n in grads_p:
        assert grads_o[n] is not None, n
        assert _rel(grads_o[n], grads_p[n]) < 5e-15, n


@pytest.mark.parametrize("name", ["chain", "residual", "mlp", "bert-mlp"])
def test_modes_match_plain_float32_3d_input(name):
    # (batch, seq, features) input, float32 against a float64 plain reference.
    torch.manual_seed(1)
    kw = dict(in_features=10, hidden=24, depth=2)
    ref = NETWORKS[name](mode="plain", dtype=torch.float64, **kw)
    x = _input(name, 0, torch.float64, shape=(3, 4, 10))
    loss_r, grads_r = _step(ref, x)
    for mode, reentrant in [("plain", False)] + _variants(name):
        net = NETWORKS[name](mode=mode, use_reentrant=reentrant, **kw)
        net.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
        loss, grads = _step(net, x.float())
        assert abs(float(loss) - float(loss_r)) < 1e-5, mode
        for n in grads_r:
            assert _rel(grads[n].double(), grads_r[n]) < 1e-5, (mode, n)


@pytest.mark.parametrize("name", list(NETWORKS))
def test_seeded_modes_have_equal_weights_and_keys(name):
    cls = NETWORKS[name]
    sds = []
    for mode in cls.MODES:
        torch.manual_seed(3)
        sds.append(cls(in_features=IN[name], hidden=8, depth=2, mode=mode).state_dict())
    for sd in sds[1:]:
        assert list(sd) == list(sds[0])
        for k in sd:
            assert torch.equal(sd[k], sds[0][k]), k


@pytest.mark.parametrize("name", list(NETWORKS))
def test_every_mode_loads_every_other_modes_weights(name):
    cls = NETWORKS[name]
    kw = dict(in_features=IN[name], hidden=9, depth=3, dtype=torch.float64)
    x = _input(name, 16, torch.float64, seed=5)
    for i, src_mode in enumerate(cls.MODES):
        torch.manual_seed(10 + i)
        src = cls(mode=src_mode, **kw)
        want = _forward(src, x).detach()
        for j, dst_mode in enumerate(cls.MODES):
            torch.manual_seed(100 + j)  # different weights until loaded
            dst = cls(mode=dst_mode, **kw)
            assert not torch.allclose(_forward(dst, x), want)
            dst.load_state_dict(src.state_dict(), strict=True)
            assert _rel(_forward(dst, x).detach(), want) < 1e-14, (src_mode, dst_mode)


@pytest.mark.parametrize("name", list(NETWORKS))
def test_no_parameter_registered_twice(name):
    cls = NETWORKS[name]
    for mode in cls.MODES:
        net = cls(in_features=IN[name], hidden=8, depth=3, mode=mode)
        every = list(net.named_parameters(remove_duplicate=False))
        assert len({id(p) for _, p in every}) == len(every), mode
        # weight and bias (where it has one) of each Linear and norm, once; a router's weight, and
        # an experts module's two stacked weights
        layers = [m for m in net.modules() if isinstance(m, (nn.Linear, nn.LayerNorm, nn.RMSNorm,
                                                             ckpt_ext.FusedLinearTanh))]
        moe = {"MixtralTopKRouter": 1, "MixtralExperts": 2}
        assert len(every) == sum(1 + (getattr(m, "bias", None) is not None) for m in layers) \
            + sum(moe.get(type(m).__name__, 0) for m in net.modules()), mode
        assert [n for n, _ in every] == list(net.state_dict()), mode


def test_writeup_net_structure():
    for mode in Net.MODES:
        net = Net(in_features=16, hidden=32, depth=3, mode=mode)
        assert type(net.linear1) is nn.Linear
        assert (net.linear1.in_features, net.linear1.out_features) == (16, 32)
        for i in (1, 2, 3):
            b = getattr(net, f"block{i}")
            assert isinstance(b, nn.Sequential) and len(b) == 2
            assert type(b[0]) is nn.Linear and (b[0].in_features, b[0].out_features) == (32, 32)
            assert isinstance(b[1], nn.Tanh)
        assert not hasattr(net, "block4")
    assert ckpt_ext.Net is Net


def test_fused_chain_is_one_stack_call(monkeypatch):
    import ckpt_ext.models as models
    calls = []
    real = models.tanh_mlp

    def spy(x, weights, biases=None, last_tanh=True):
        calls.append((len(weights), last_tanh))
        return real(x, weights, biases, last_tanh)

    monkeypatch.setattr(models, "tanh_mlp", spy)
    net = Net(in_features=4, hidden=8, depth=4, mode="fused")
    net(torch.randn(2, 4)).mean().backward()
    assert calls == [(4, True)]
    assert all(p.grad is not None for p in net.parameters())


def _spy_checkpoint(monkeypatch):
    import ckpt_ext.models as models
    seen = []
    real = models.checkpoint

    def spy(fn, *args, **kwargs):
        seen.append((fn, kwargs.get("use_reentrant")))
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(models, "checkpoint", spy)
    return seen


def test_writeup_checkpoint_wraps_block1_and_block2_only(monkeypatch):
    seen = _spy_checkpoint(monkeypatch)
    for reentrant in (False, True):
        seen.clear()
        net = Net(in_features=4, hidden=8, depth=3, mode="checkpoint", use_reentrant=reentrant)
        net(torch.randn(2, 4)).mean().backward()
        assert seen == [(net.block1, reentrant), (net.block2, reentrant)]
    # No graph, no checkpoint: under no_grad the blocks just run.
    seen.clear()
    with torch.no_grad():
        net(torch.randn(2, 4))
    assert seen == []


def test_checkpoint_stack_wraps_all_blocks_in_one_call(monkeypatch):
    seen = _spy_checkpoint(monkeypatch)
    net = Net(in_features=4, hidden=8, depth=3, mode="checkpoint-stack")
    net(torch.randn(2, 4)).mean().backward()
    assert seen == [(net._stack, False)]


def test_mlp_fused_block_is_a_stack_over_fc1_fc2():
    net = MLPNet(in_features=4, hidden=6, depth=2, mode="fused")
    for block in net.blocks:
        assert isinstance(block, ckpt_ext.FusedTanhMLP)
        assert block.sizes == [6, 24, 6] and block.last_tanh is False
        assert [n for n, _ in block.named_children()] == ["fc1", "fc2"]
        assert type(block.fc1) is nn.Linear and type(block.fc2) is nn.Linear


def test_pinn_structure():
    for mode in PINNNet.MODES:
        net = PINNNet(hidden=64, depth=4, mode=mode)
        linears = [m for m in net.mlp.modules() if type(m) is nn.Linear]
        assert [(m.in_features, m.out_features) for m in linears] == \
            [(2, 64), (64, 64), (64, 64), (64, 64), (64, 1)]
    fused = PINNNet(mode="fused")
    assert isinstance(fused.mlp, ckpt_ext.FusedTanhMLP) and fused.mlp.last_tanh is False
    p = PINNNet.points(64, torch.Generator().manual_seed(0))
    assert p.requires_grad and p.shape == (64, 2)
    assert set(p[:8, 1].tolist()) == {0.0, 1.0} and (p[8:16, 0] == 0).all()


def test_bad_arguments():
    with pytest.raises(ValueError, match="Net: mode must be one of plain, checkpoint, "
                                         "checkpoint-stack, fused, got 'fast'"):
        Net(4, 8, mode="fast")
    with pytest.raises(ValueError, match="ResidualNet: mode must be one of plain, checkpoint, "
                                         "fused, got 'checkpoint-stack'"):
        ResidualNet(4, 8, mode="checkpoint-stack")
    with pytest.raises(TypeError, match="use_reentrant must be a bool, got NoneType"):
        ResidualNet(4, 8, mode="checkpoint", use_reentrant=None)
    with pytest.raises(ValueError, match="depth must be >= 1, got 0"):
        Net(4, 8, depth=0)
    with pytest.raises(ValueError, match="depth must be >= 1, got 0"):
        MLPNet(4, 8, depth=0)
    with pytest.raises(ValueError, match="in_features must be 2 .* got 3"):
        PINNNet(3)
    with pytest.raises(ValueError, match="PINNNet: activation must be one of tanh, .* got 'cos'"):
        PINNNet(activation="cos")
    with pytest.raises(ValueError, match="BertMLPNet: use_reentrant=True would give the first "
                                         "block no gradients"):
        BertMLPNet(8, 16, mode="checkpoint", use_reentrant=True)


def test_fused_mlp_grad_only_for_input():
    # Frozen weights: the fused MLP block still returns the input gradient (and only that).
    torch.manual_seed(2)
    kw = dict(in_features=5, hidden=6, depth=2, dtype=torch.float64)
    plain, fused = MLPNet(mode="plain", **kw), MLPNet(mode="fused", **kw)
    fused.load_state_dict(plain.state_dict())
    for net in (plain, fused):
        net.requires_grad_(False)
    x = torch.randn(3, 5, dtype=torch.float64)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    plain(xs[0]).sum().backward()
    fused(xs[1]).sum().backward()
    assert _rel(xs[1].grad, xs[0].grad) < 1e-12
    assert all(p.grad is None for p in fused.parameters())


def _step_flops(net, x):
    # addmm_ too (the unsloth mode's backward accumulates in place), which the counter's own table
    # leaves out
    addmm_ = lambda self_shape, a, b, **_: 2 * a[0] * a[1] * b[1]  # noqa: E731
    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: addmm_}) as counter:
        type(net).loss(_forward(net, x), x).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("name", ["chain", "residual", "mlp", "bert-mlp", "llama-lora",
                                  "llama-lora-dropout", "moe"])
def test_recomputed_gemms_are_the_extra_flops(name):
    # The benchmark's floor adds these GEMMs to plain's step: they must be exactly what each mode
    # computes beyond plain (FlopCounterMode counts the recompute inside checkpoint and, through
    # the ops' FLOP formulas, inside the fused backward).
    B, K, H, D = 6, 5, 8, 3
    plain = NETWORKS[name](in_features=K, hidden=H, depth=D)
    x = torch.randn(B, K)
    base = _step_flops(plain, x)
    for mode in NETWORKS[name].MODES:
        net = NETWORKS[name](in_features=K, hidden=H, depth=D, mode=mode)
        gemms = recomputed_gemms(name, mode, B, K, H, D)
        assert _step_flops(net, x) - base == sum(2 * m * k * n for m, k, n in gemms), mode
    # moe: FlopCounterMode's module tracker cannot hook the router's input under reentrant
    # checkpoint (a view made in its no_grad forward); the re-run is the whole MoE block either way
    if ("checkpoint", True) in _variants(name) and name != "moe":
        net = NETWORKS[name](in_features=K, hidden=H, depth=D, mode="checkpoint",
                             use_reentrant=True)
        gemms = recomputed_gemms(name, "checkpoint", B, K, H, D, use_reentrant=True)
        assert _step_flops(net, x) - base == sum(2 * m * k * n for m, k, n in gemms)
    for pinn in ("pinn", "pinn-sin", "pinn-silu"):
        assert recomputed_gemms(pinn, "fused", B, 2, H, D) is None


def test_bert_mlp_structure_and_formula():
    # BertIntermediate + BertOutput: h = LayerNorm(h + W2 gelu(W1 h + b1) + b2), eps 1e-12
    for mode in BertMLPNet.MODES:
        net = BertMLPNet(in_features=12, hidden=20, depth=2, mode=mode, dtype=torch.float64)
        assert list(net.state_dict()) == [f"blocks.{i}.{k}" for i in range(2) for k in (
            "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias", "norm.weight",
            "norm.bias")]
        for block in net.blocks:
            assert type(block.norm) is nn.LayerNorm and block.norm.eps == 1e-12
            if mode == "fused":
                assert isinstance(block.mlp, ckpt_ext.FusedMLP)
                assert block.mlp.activation == "gelu" and block.mlp.sizes == [12, 20, 12]
            else:
                assert [type(m) for m in block.mlp] == [nn.Linear, nn.GELU, nn.Linear]
                assert block.mlp[1].approximate == "none"
        for blk in net.blocks:  # LayerNorm's own initial values would hide a wrong formula
            nn.init.normal_(blk.norm.weight)
            nn.init.normal_(blk.norm.bias)
        x = torch.randn(3, 5, 12, dtype=torch.float64)
        h = x
        for blk in net.blocks:
            w1, b1, w2, b2 = blk.mlp.state_dict().values()
            z = h @ w1.T + b1
            s = h + 0.5 * z * (1 + torch.erf(z / 2 ** 0.5)) @ w2.T + b2
            h = (s - s.mean(-1, keepdim=True)) / (s.var(-1, unbiased=False, keepdim=True)
                                                  + 1e-12).sqrt()
            h = h * blk.norm.weight.detach() + blk.norm.bias.detach()
        assert _rel(net(x).detach(), h) < 1e-13, mode


def test_pinn_activations():
    assert set(ACTIVATION_MODULES) == set(ckpt_ext.ACTIVATIONS)
    for name, act in (("pinn", "tanh"), ("pinn-sin", "sin"), ("pinn-silu", "silu")):
        cls = NETWORKS[name]
        for mode in cls.MODES:
            net = cls(hidden=8, depth=3, mode=mode)
            assert net.activation == act
            if mode == "fused" and act != "tanh":
                assert isinstance(net.mlp, ckpt_ext.FusedMLP)
                assert net.mlp.activation == act and net.mlp.sizes == [2, 8, 8, 8, 1]
            elif mode != "fused":
                acts = [type(m) for m in net.mlp if type(m) is not nn.Linear]
                assert acts == [type(ACTIVATION_MODULES[act]())] * 3, (name, mode)
    # the argument picks the activation of any of them; the default keeps tanh's FusedTanhMLP
    assert PINNNet(hidden=8, activation="sin").activation == "sin"
    assert isinstance(PINNNet(hidden=8, mode="fused").mlp, ckpt_ext.FusedTanhMLP)


# What each mode of the new networks keeps, in exact bytes (the CPU meter counts every storage).
RNG = torch.get_rng_state().nbytes  # checkpoint keeps the CPU RNG state per call


@pytest.fixture
def meter():
    with ckpt_ext.memory.MemoryMeter("cpu") as m:
        yield m


def _measured(name, mode, meter, batch, **kw):
    torch.manual_seed(0)
    net = NETWORKS[name](mode=mode, **kw)
    x = _input(name, batch, torch.float32,
               shape=None if is_pinn(name) else (batch, kw["in_features"]))
    ckpt_ext.memory.clear_grads(net)
    return ckpt_ext.memory.measured_step(net, x, meter, loss_fn=type(net).loss)


def test_bert_mlp_kept_bytes(meter):
    B, W, H, D = 24, 16, 64, 3
    unit, stats = B * W * 4, 2 * B * 4  # a (tokens, W) activation; LayerNorm's mean and rstd
    got = {m: _measured("bert-mlp", m, meter, B, in_features=W, hidden=H, depth=D)
           for m in BertMLPNet.MODES}
    # every mode: LayerNorm keeps its input h + mlp(h) and its statistics per block, and each
    # block's input is the block below's output (the first block's, the input x, is not counted)
    common = D * (unit + stats) + (D - 1) * unit
    # plain also keeps the (tokens, H) GELU input and output
    assert got["plain"]["kept_for_backward"] == common + D * 2 * (H // W) * unit
    assert got["checkpoint"]["kept_for_backward"] == common + D * RNG
    assert got["fused"]["kept_for_backward"] == common  # the MLP keeps only its input
    assert got["fused"]["peak_above_before_forward"] <= got["plain"]["peak_above_before_forward"]
    assert got["fused"]["peak_above_before_forward"] <= \
        got["checkpoint"]["peak_above_before_forward"]


@pytest.mark.parametrize("name", ["pinn-sin", "pinn-silu"])
def test_pinn_fused_keeps_and_peaks_below_plain(meter, name):
    got = {m: _measured(name, m, meter, 512, hidden=32, depth=4) for m in ("plain", "fused")}
    for what in ("kept_for_backward", "peak_above_before_forward"):
        assert 0 < got["fused"][what] <= got["plain"][what], what


# ---- llama-lora, llama-lora-dropout, moe ---------------------------------------------------------

LORA_NETS = ("llama-lora", "llama-lora-dropout")


@pytest.mark.parametrize("p", [0.0, 0.05])
def test_lora_linear_is_peft_lora_linear(p):
    # The same weights in peft's own lora.Linear: the same output to the bit, the same LoRA
    # gradients, and with dropout the same masks from the same seed. Bitwise because both run the
    # same ops in the same order (base_layer(x) + lora_B(lora_A(dropout(x))) * scaling, each an
    # nn.Linear on contiguous weights of the same shapes): the same GEMM calls on the same layouts.
    peft = pytest.importorskip("peft")
    from ckpt_ext.models import LoRALinear
    torch.manual_seed(0)
    ours = LoRALinear(12, 20, r=4, alpha=8, dropout=p, dtype=torch.float64)
    holder = nn.Module()
    holder.proj = nn.Linear(12, 20, bias=False, dtype=torch.float64)
    peft.get_peft_model(holder, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=p,
                                                target_modules=["proj"]))
    theirs = holder.proj
    assert type(theirs).__module__ == "peft.tuners.lora.layer"
    theirs.base_layer.weight.data.copy_(ours.base_layer.weight)
    theirs.lora_A["default"].weight.data.copy_(ours.lora_A.weight)
    theirs.lora_B["default"].weight.data.copy_(ours.lora_B.weight)
    assert theirs.scaling["default"] == ours.scaling == 2.0
    assert [n for n, q in ours.named_parameters() if q.requires_grad] == \
        ["lora_A.weight", "lora_B.weight"]
    x = torch.randn(3, 5, 12, dtype=torch.float64)
    y_ours, y_theirs = _forward(ours, x), _forward(theirs, x)
    assert torch.equal(y_ours, y_theirs)
    y_ours.square().sum().backward()
    y_theirs.square().sum().backward()
    for a, b in ((ours.lora_A, theirs.lora_A["default"]), (ours.lora_B, theirs.lora_B["default"])):
        assert torch.equal(a.weight.grad, b.weight.grad)


LORA_KERNEL_MODES = [(n, m) for n in LORA_NETS
                     for m in ("fused", "checkpoint-fused", "unsloth", "liger")
                     if m in NETWORKS[n].MODES]


@pytest.mark.parametrize("name,mode", LORA_KERNEL_MODES)
def test_lora_modes_match_plain_outputs_and_lora_grads(name, mode):
    # float64, odd widths, a (batch, seq, W) input; dropout under the same seed draws the same
    # masks in plain and fused. Measured over 5 seeds: output 6.8e-18, gradients 4.7e-16
    # relative; the bounds are 10x that.
    torch.manual_seed(4)
    kw = dict(in_features=9, hidden=23, depth=2, dtype=torch.float64)
    plain = NETWORKS[name](mode="plain", **kw)
    other = NETWORKS[name](mode=mode, **kw)
    other.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3, 9, dtype=torch.float64, requires_grad=True)
    outs, grads = [], []
    for net in (plain, other):
        x.grad = None
        y = _forward(net, x)
        y.backward(torch.linspace(-1, 1, y.numel(), dtype=torch.float64).view(y.shape))
        outs.append(y.detach())
        grads.append({n: q.grad for n, q in net.named_parameters() if q.requires_grad}
                     | {"x": x.grad})
    assert _rel(outs[1], outs[0]) < 7e-17
    assert len(grads[0]) == 2 * 2 * 3 + 1  # A and B of gate, up and down per block, and x
    for n in grads[0]:
        assert _rel(grads[1][n], grads[0][n]) < 5e-15, n


def test_lora_dropout_draws_masks():
    # The dropout network's masks matter: another seed gives another output, in plain and fused;
    # in eval mode none is drawn, and it computes what llama-lora computes.
    for mode in ("plain", "fused"):
        torch.manual_seed(0)
        kw = dict(in_features=8, hidden=16, depth=1, mode=mode, dtype=torch.float64)
        net = NETWORKS["llama-lora-dropout"](**kw)
        x = torch.randn(6, 8, dtype=torch.float64)
        a = _forward(net, x)
        torch.manual_seed(99)
        assert not torch.allclose(net(x), a), mode
        no_dropout = NETWORKS["llama-lora"](**kw)
        no_dropout.load_state_dict(net.state_dict())
        net.eval()
        assert torch.equal(net(x), no_dropout(x)), mode


def test_unsloth_mode_is_exact_and_refuses_dropout():
    torch.manual_seed(5)
    kw = dict(in_features=16, hidden=40, depth=2)
    plain = NETWORKS["llama-lora"](mode="plain", **kw)
    unsloth = NETWORKS["llama-lora"](mode="unsloth", **kw)
    unsloth.load_state_dict(plain.state_dict())
    x = torch.randn(7, 16)
    # the forward is plain's ops in plain's order (F.linear on the same weights and input): the
    # same GEMM calls on the same layouts, so the same bits
    assert torch.equal(unsloth(x), plain(x))
    # it writes h and the gradients over the gate and up outputs it kept: a second backward
    # through the graph fails loudly, never reads them
    loss = unsloth(x).mean()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with pytest.raises(ValueError, match="unsloth kernel runs only at lora_dropout 0 .* got 0.05"):
        NETWORKS["llama-lora"](mode="unsloth", lora_dropout=0.05, **kw)
    with pytest.raises(ValueError, match="LlamaLoRADropoutNet: mode must be one of plain, "
                                         "checkpoint, fused, liger, checkpoint-fused, got "
                                         "'unsloth'"):
        NETWORKS["llama-lora-dropout"](mode="unsloth", **kw)
    with pytest.raises(ValueError, match="use_reentrant=True would give the first block no"):
        NETWORKS["llama-lora"](mode="checkpoint", use_reentrant=True, **kw)


def test_lora_kept_bytes(meter):
    # Exact bytes. Every mode keeps each MLP's input n (T, W) and, from the second block on, what
    # the frozen RMSNorm keeps: its input h and its (T, 1) rsqrt. Plain also keeps per block
    # g, silu(g), u and their product (T, I each), three LoRA A outputs (T, r) and the 8-byte
    # scalar of each `* scaling`; Liger's policy all of that but silu(g); Unsloth's policy g and u;
    # checkpoint an RNG state per call.
    T, W, I, D = 24, 16, 40, 3
    r = NETWORKS["llama-lora"].RANK
    common = D * T * W * 4 + (D - 1) * (T * W * 4 + T * 4)
    got = {(name, m): _measured(name, m, meter, T, in_features=W, hidden=I, depth=D)
           for name in LORA_NETS for m in NETWORKS[name].MODES}
    kept = {k: v["kept_for_backward"] for k, v in got.items()}
    for name in LORA_NETS:
        assert kept[name, "checkpoint"] == common + D * (RNG + 3 * 8)
    assert kept["llama-lora", "plain"] == common + D * (4 * T * I * 4 + 3 * T * r * 4 + 3 * 8)
    assert kept["llama-lora", "fused"] == common
    assert kept["llama-lora", "unsloth"] == common + D * 2 * T * I * 4
    assert kept["llama-lora", "liger"] == \
        common + D * (3 * T * I * 4 + 3 * T * r * 4 + 3 * 8)
    assert kept["llama-lora", "checkpoint-fused"] == common + D * RNG
    # with dropout the fused op keeps the generator's state too, and so does the checkpoint
    # around it; plain keeps the masks and the dropped inputs besides
    assert kept["llama-lora-dropout", "fused"] == common + D * RNG
    assert kept["llama-lora-dropout", "checkpoint-fused"] == common + 2 * D * RNG
    assert kept["llama-lora-dropout", "plain"] > kept["llama-lora", "plain"]
    for name in LORA_NETS:
        peak = {m: got[name, m]["peak_above_before_forward"] for m in NETWORKS[name].MODES}
        assert peak["fused"] <= peak["plain"], name
    peak = {m: got["llama-lora", m]["peak_above_before_forward"] for m in LlamaLoRANet.MODES}
    assert peak["fused"] <= min(peak["checkpoint"], peak["unsloth"])


def test_moe_is_mixtrals_sparse_block():
    # SparseMoE on rows is transformers' MixtralSparseMoeBlock (its router and experts, no
    # jitter) on (batch, seq, W), to the bit, in the grouped_mm implementation and the eager one:
    # both run the same router and experts modules on the same (batch·seq, W) rows.
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    from transformers import MixtralConfig
    for dtype, impl in ((torch.float32, "grouped_mm"), (torch.float64, "eager")):
        torch.manual_seed(6)
        net = NETWORKS["moe"](in_features=32, hidden=24, depth=1, dtype=dtype)
        moe = net.blocks[0].mlp
        assert net.experts_implementation == moe.experts.config._experts_implementation == impl
        config = MixtralConfig(hidden_size=32, intermediate_size=24, num_local_experts=8,
                               num_experts_per_tok=2, hidden_act="silu")
        config._experts_implementation = impl
        block = mixtral.MixtralSparseMoeBlock(config).to(dtype)
        block.load_state_dict(moe.state_dict())
        assert block.jitter_noise == 0
        x = torch.randn(2, 5, 32, dtype=dtype)
        assert torch.equal(moe(x), block(x)), impl


def test_moe_experts_implementation():
    from ckpt_ext.models import experts_implementation
    assert experts_implementation(torch.float32, 1024, 1408) == "grouped_mm"
    assert experts_implementation(torch.bfloat16, 4096, 5504) == "grouped_mm"
    assert experts_implementation(torch.float64, 1024, 1408) == "eager"  # not on the CPU
    assert experts_implementation(torch.float32, 1024, 1407) == "eager"  # rows of 16 bytes


def test_moe_grouped_mm_modes_match_plain_float32():
    # The bench's own path: float32, widths grouped_mm takes, every mode against plain.
    torch.manual_seed(7)
    kw = dict(in_features=32, hidden=48, depth=2)
    plain = NETWORKS["moe"](mode="plain", **kw)
    assert plain.experts_implementation == "grouped_mm"
    x = torch.randn(40, 32)
    loss_p, grads_p = _step(plain, x)
    for mode in MoENet.MODES[1:]:
        net = NETWORKS["moe"](mode=mode, **kw)
        net.load_state_dict(plain.state_dict())
        loss, grads = _step(net, x)
        assert abs(float(loss - loss_p)) < 1e-7, mode
        for n in grads_p:
            assert _rel(grads[n], grads_p[n]) < 1e-5, (mode, n)


def test_moe_kept_bytes(meter):
    # Exact bytes. Every mode keeps per block the experts' input n and what the RMSNorm keeps: h·rsqrt
    # for its weight's gradient and, from the second block on (the first one's input x needs no
    # gradient), its input h and (T, 1) rsqrt; checkpoint an RNG state per call; fused the routing
    # besides (MoENet.routing_bytes); plain every expert's rows and intermediates.
    T, W, I, D = 32, 16, 24, 3
    got = {m: _measured("moe", m, meter, T, in_features=W, hidden=I, depth=D)
           for m in MoENet.MODES}
    kept = {m: r["kept_for_backward"] for m, r in got.items()}
    common = D * 2 * T * W * 4 + (D - 1) * (T * W * 4 + T * 4)
    assert kept["checkpoint"] == common + D * RNG
    assert kept["fused"] == common + MoENet.routing_bytes(T, D)
    assert kept["plain"] > 2 * kept["fused"]
    assert got["fused"]["peak_above_before_forward"] <= got["plain"]["peak_above_before_forward"]


def test_moe_needs_transformers(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    with pytest.raises(ImportError, match="SparseMoE builds transformers' Mixtral router and "
                                          "experts; transformers is not importable here"):
        NETWORKS["moe"](in_features=8, hidden=8, depth=1)
    assert MoENet.REQUIRES == ("transformers",)

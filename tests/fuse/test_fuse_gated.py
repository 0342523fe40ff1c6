"""Gated MLPs (``down(act(gate(x)) * up(x))``: SwiGLU, GeGLU) under plain ``fuse``: transformers'
Llama/Mistral/Qwen2/Gemma/Phi3 MLPs, T5's gated dense layer and hand-written ones fuse as one
``gated_mlp`` unit per layer; outputs and every gradient match an unfused deepcopy in float64,
train and eval; and every caller still gets what the unfused model computes (hooks, changed
settings, members on their own, pickle, compile, torch.func, code fx did not see run)."""
from __future__ import annotations

import copy
import io
import os
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ckpt_ext import fuse, unfuse
from ckpt_ext.convert import RunLinear
from _ecosys import assert_same_greedy_tokens, measured, rel_err, saved_activation_bytes

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

H, I = 8, 16
# The fused MLPs' logits against the unfused model's: measured 0 here; the same plain model's
# logits under other MKL/oneDNN/ATen kernels (make test-dispatch's variables) move by up to
# 1.3e-7 (GPT-2; Llama 8.3e-8) relative, so a bound of ~8x that.
GENERATE_TOL = 1e-6


def _attn(**kw):
    return dict(vocab_size=50, hidden_size=H, intermediate_size=I, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, head_dim=4,
                max_position_embeddings=32, **kw)


def _t5(ff: str, dropout: float = 0.0):
    return transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=50, d_model=H, d_kv=4, d_ff=I, num_layers=2, num_heads=2,
        dropout_rate=dropout, feed_forward_proj=ff))


LIBRARY = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**_attn())),
    "mistral": lambda: transformers.MistralModel(transformers.MistralConfig(**_attn())),
    "qwen2": lambda: transformers.Qwen2Model(transformers.Qwen2Config(**_attn())),
    "gemma": lambda: transformers.GemmaModel(transformers.GemmaConfig(
        **_attn(hidden_activation="gelu_pytorch_tanh"))),
    "phi3": lambda: transformers.Phi3Model(transformers.Phi3Config(**_attn(pad_token_id=0))),
    "t5 gated-gelu": lambda: _t5("gated-gelu"),
    "t5 gated-gelu_pytorch_tanh": lambda: _t5("gated-gelu_pytorch_tanh"),
    "t5 gated-gelu, dropout 0.1": lambda: _t5("gated-gelu", 0.1),
}


class Mine(nn.Module):
    """A hand-written SwiGLU: the activation is a function call."""

    def __init__(self, bias: bool = False):
        super().__init__()
        self.w1, self.w3 = nn.Linear(H, I, bias=bias), nn.Linear(H, I, bias=bias)
        self.w2 = nn.Linear(I, H, bias=bias)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class UpFirst(nn.Module):
    """``up * act(gate)``, the up projection called first, an activation module, biases."""

    def __init__(self):
        super().__init__()
        self.up, self.gate, self.down = nn.Linear(H, I), nn.Linear(H, I), nn.Linear(I, H)
        self.act = nn.GELU(approximate="tanh")

    def forward(self, x):
        u = self.up(x)
        return self.down(u * self.act(self.gate(x)))


class GateSecond(nn.Module):
    """One packed Linear, ``up, gate = chunk(2, dim=-1)``: the activation on the second half."""

    def __init__(self):
        super().__init__()
        self.gate_up, self.down = nn.Linear(H, 2 * I), nn.Linear(I, H)

    def forward(self, x):
        up, gate = self.gate_up(x).chunk(2, dim=-1)
        return self.down(torch.tanh(gate) * up)


class Unrecorded(Mine):
    """A statement fx does not record: its condition is False on a Proxy, True at call time."""

    def forward(self, x):
        h = F.silu(self.w1(x)) * self.w3(x)
        if isinstance(h, torch.Tensor):
            h = h * 2
        return self.w2(h)


HANDWRITTEN = {"mine": Mine, "mine, bias": lambda: Mine(bias=True), "up * act(gate)": UpFirst,
               "gate second": GateSecond}


def _gated(report):
    return [d for d in report.fused if d.unit.startswith("gated_mlp")]


def _output(out):
    if isinstance(out, torch.Tensor):
        return out
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _close(a, b, what, rtol=1e-14):
    scale = b.abs().max().clamp_min(1e-300)
    assert (a - b).abs().max() <= rtol * scale, f"{what}: {(a - b).abs().max() / scale:.3g}"


def _compare(plain, fused, inputs, grad_rtol=1e-14, modes=(True, False)):
    for mode in modes:
        plain.train(mode)
        fused.train(mode)
        torch.manual_seed(0)  # the same Dropout masks
        a = _output(plain(*inputs))
        torch.manual_seed(0)
        b = _output(fused(*inputs))
        _close(b, a, f"output, train={mode}")
        ga = torch.autograd.grad(a.square().sum(), list(plain.parameters()), allow_unused=True)
        gb = torch.autograd.grad(b.square().sum(), list(fused.parameters()), allow_unused=True)
        # Each gradient's error against the largest gradient of the model: a parameter whose
        # gradient is a sum of cancelling terms (T5's embedding: 1e-5 where others are near 1)
        # carries the rounding of those terms, which is small against the model's scale only.
        scale = max(x.abs().max() for x in ga if x is not None).clamp_min(1e-300)
        for (name, _), x, y in zip(plain.named_parameters(), ga, gb):
            assert (x is None) == (y is None), name
            if x is not None:
                err = (y - x).abs().max() / scale
                assert err <= grad_rtol, f"grad of {name}, train={mode}: {err:.3g}"


@pytest.mark.parametrize("name", list(LIBRARY))
def test_transformers_mlp_is_one_unit_and_exact(name):
    torch.manual_seed(0)
    plain = LIBRARY[name]().double()
    fused = copy.deepcopy(plain)
    _, report = fuse(fused)
    mlps = [d for d in _gated(report)]
    assert len(mlps) == 2, str(report)
    for d in mlps:
        assert d.how == "children" and d.bytes_per_row > 0, d
        assert not any(d.layers[-1] in e.layers for e in report.decisions if e is not d), report
    assert not any("gated product" in why for _, why in report.other_layers), report
    _compare(plain, fused, (torch.randint(0, 50, (2, 5)),))


@pytest.mark.parametrize("name", list(HANDWRITTEN))
def test_handwritten_gated_mlp_is_one_unit_and_exact(name):
    torch.manual_seed(0)
    plain = HANDWRITTEN[name]().double()
    fused = copy.deepcopy(plain)
    _, report = fuse(fused)
    assert len(_gated(report)) == 1 and len(report.fused) == 1, str(report)
    assert report.other_layers == [], report
    x = torch.randn(3, 4, H, dtype=torch.float64)
    _compare(plain, fused, (x,))
    xg = x.clone().requires_grad_()
    gx = torch.autograd.grad(fused(xg).sum(), xg)[0]
    _close(gx, torch.autograd.grad(plain(xg).sum(), xg)[0], "grad of x")


def test_llama_generate_save_and_unfuse(tmp_path):
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_attn())).eval()
    fused = copy.deepcopy(plain)
    fuse(fused)
    assert isinstance(fused.model.layers[0].mlp.gate_proj, RunLinear)
    ids = torch.randint(1, 50, (1, 4))
    # float32 logits within GENERATE_TOL of the unfused model's (not bitwise: gated_mlp's GEMMs
    # write into halves of one buffer and its SiLU is ckpt_ext's kernel)
    assert_same_greedy_tokens(plain, fused, ids, GENERATE_TOL, "fuse.gated.generate",
                              max_new_tokens=6, pad_token_id=0)
    fused.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded.model.layers[0].mlp.gate_proj) is nn.Linear
    assert torch.equal(loaded(ids).logits, plain(ids).logits)  # the same modules and weights
    assert measured("fuse.gated.logits", rel_err(fused(ids).logits, loaded(ids).logits)) <= \
        GENERATE_TOL
    unfuse(fused)
    for layer in fused.model.layers:
        mlp = layer.mlp
        assert all(type(getattr(mlp, n)) is nn.Linear for n in ("gate_proj", "up_proj",
                                                                "down_proj"))
        assert "forward" not in vars(mlp)
    assert torch.equal(plain(ids).logits, fused(ids).logits)


def test_kept_bytes_drop_by_the_mlp_intermediates():
    """float32 training step: what autograd keeps drops by at least 80 % of the bytes the MLPs'
    intermediates (act input and output, up output, product: 4 tensors of I) take unfused,
    measured, and by what the report claims."""
    torch.manual_seed(0)
    plain = transformers.LlamaModel(transformers.LlamaConfig(**_attn()))
    fused = copy.deepcopy(plain)
    _, report = fuse(fused)
    ids = torch.randint(0, 50, (3, 7))
    rows = ids.numel()
    drop = saved_activation_bytes(plain, ids) - saved_activation_bytes(fused, ids)
    intermediates = 2 * rows * 4 * I * 4
    assert drop >= 0.8 * intermediates, (drop, intermediates)
    assert drop == report.bytes_per_row * rows, (drop, str(report))


# -- every caller gets what the unfused model computes -------------------------------------------

def _llama_mlp():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**_attn(hidden_act="silu"))
    from transformers.models.llama.modeling_llama import LlamaMLP
    plain = LlamaMLP(config).double()
    return plain, copy.deepcopy(plain), torch.randn(2, 3, H, dtype=torch.float64)


@pytest.mark.parametrize("name", ["gate_proj", "act_fn", "up_proj", "down_proj"])
def test_hook_after_fuse_computes_module_by_module(name):
    plain, fused, x = _llama_mlp()
    fuse(fused)
    seen = []
    getattr(fused, name).register_forward_hook(lambda m, a, out: seen.append(out))
    _close(fused(x), plain(x), "output")
    want = {"gate_proj": I, "act_fn": I, "up_proj": I, "down_proj": H}[name]
    assert len(seen) == 1 and seen[0].shape[-1] == want


def test_activation_setting_changed_after_fuse():
    torch.manual_seed(0)
    plain = UpFirst().double()
    fused = copy.deepcopy(plain)
    fuse(fused)
    plain.act.approximate = fused.act.approximate = "none"
    x = torch.randn(5, H, dtype=torch.float64)
    assert torch.equal(fused(x), plain(x))


def test_members_on_their_own_compute_their_own_output():
    plain, fused, x = _llama_mlp()
    fuse(fused)
    assert torch.equal(fused.gate_proj(x), plain.gate_proj(x))
    assert torch.equal(fused.up_proj(x), plain.up_proj(x))
    h = torch.randn(2, 3, I, dtype=torch.float64)
    assert torch.equal(fused.down_proj(h), plain.down_proj(h))


def test_pickle_deepcopy_unfuse():
    plain, fused, x = _llama_mlp()
    fuse(fused)
    buf = io.BytesIO()
    torch.save(fused, buf)
    buf.seek(0)
    for other in (pickle.loads(pickle.dumps(fused)), copy.deepcopy(fused),
                  torch.load(buf, weights_only=False)):
        assert isinstance(other.gate_proj, RunLinear)
        assert other.gate_proj._ckpt_ext_run is other.down_proj._ckpt_ext_run
        assert other.gate_proj._ckpt_ext_run.down is other.down_proj
        assert torch.equal(other(x), fused(x))
        _, again = fuse(other)
        assert [d.action for d in again.decisions] == ["already fused"], again
    unfuse(fused)
    assert type(fused.gate_proj) is nn.Linear and "forward" not in vars(fused)
    assert torch.equal(fused(x), plain(x))


@pytest.mark.parametrize("make,backend", [("llama", "eager"), ("phi3 packed", "aot_eager")])
def test_compile_fullgraph_and_torch_func(make, backend):
    plain, fused, x = _llama_mlp() if make == "llama" else _phi3_mlp()
    assert len(_gated(fuse(fused).report)) == 1
    compiled = torch.compile(fused, fullgraph=True, backend=backend)
    _close(compiled(x), plain(x), "compiled")
    params = dict(fused.named_parameters())
    grads = torch.func.grad(lambda p: torch.func.functional_call(fused, p, (x,)).sum())(params)
    ref = torch.autograd.grad(plain(x).sum(), list(plain.parameters()))
    for (name, _), r in zip(plain.named_parameters(), ref):
        _close(grads[name], r, name)


def test_unrecorded_statement_is_refused_with_the_reason():
    torch.manual_seed(0)
    plain = Unrecorded().double()
    fused = copy.deepcopy(plain)
    _, report = fuse(fused)
    assert not _gated(report), str(report)
    assert any("fx did not see run" in d.why for d in report.near_misses), \
        str(report)
    x = torch.randn(4, H, dtype=torch.float64)
    assert torch.equal(fused(x), plain(x))


def test_report_names_the_unit_and_its_bytes():
    _, report = fuse(Mine(), dry_run=True)
    (d,) = report.decisions
    assert d.layers == ("w1", "F.silu", "w3", "w2") and d.activation == "silu"
    assert d.unit == f"gated_mlp silu, {H}->2x{I}->{H}"
    assert d.bytes_per_row == 4 * I * 4  # silu's input and output, up, the product (float32)
    _, packed = fuse(GateSecond(), dry_run=True)
    # tanh keeps its output only: the up half keeps the whole packed output alive
    assert packed.decisions[0].bytes_per_row == (1 + 2 + 1) * I * 4, packed


def test_dropout_p_set_after_fuse_draws_the_same_masks():
    """A Dropout fused at p=0 and set to p>0 afterwards draws the mask the unfused model draws:
    the same output under the same seed, and the generator left in the same state."""
    torch.manual_seed(0)
    plain = _t5("gated-gelu").double()
    fused = copy.deepcopy(plain)
    assert len(_gated(fuse(fused).report)) == 2
    for m in (plain, fused):
        for block in m.encoder.block:
            block.layer[-1].DenseReluDense.dropout.p = 0.1
        m.train()
    ids = torch.randint(0, 50, (2, 5))
    torch.manual_seed(1)
    a = plain(ids).last_hidden_state
    after_plain = torch.get_rng_state()
    torch.manual_seed(1)
    b = fused(ids).last_hidden_state
    assert torch.equal(torch.get_rng_state(), after_plain)
    _close(b, a, "output")


GATED_FLAGS = {"path": None}
PATHS = ["skip up", "scale x", "scale product"]


def _scaled(h, path):
    """A helper of the user's that reads a module-level flag."""
    return h * 2 if GATED_FLAGS["path"] == path else h


class GlobalPath(Mine):
    """A gated MLP whose forward branches on a module-level flag the analysis cannot see, in
    conditional expressions: every statement runs while tracing, one branch of each does not."""

    def forward(self, x):
        path = GATED_FLAGS["path"]
        g = F.silu(self.w1(x))
        h = g if path == "skip up" else g * self.w3(x * 2 if path == "scale x" else x)
        h = h * 2 if path == "scale product" else h
        return self.w2(h)


class HelperPath(Mine):
    """The same flag read inside a helper function the forward calls."""

    def forward(self, x):
        h = F.silu(self.w1(x)) * self.w3(_scaled(x, "scale x"))
        return self.w2(_scaled(h, "scale product"))


@pytest.mark.parametrize("cls,why", [(GlobalPath, "fx did not see run"),
                                     (HelperPath, "calls _scaled")])
def test_gated_path_through_state_outside_the_module_is_left_alone(cls, why):
    # Such a path may put an op between the product and the down projection, which a
    # placeholder would take without a trace: the unit is refused, with the reason, and every
    # path gives the unfused result.
    torch.manual_seed(0)
    plain = cls().double()
    fused = copy.deepcopy(plain)
    _, report = fuse(fused)
    assert not _gated(report), str(report)
    assert any(why in d.why for d in report.near_misses), str(report)
    x = torch.randn(3, H, dtype=torch.float64)
    try:
        for path in [None] + PATHS:
            GATED_FLAGS["path"] = path
            assert torch.equal(fused(x), plain(x)), path
    finally:
        GATED_FLAGS["path"] = None


def _skip_up(self, x):
    return self.w2(F.silu(self.w1(x)))


def _scale_product(self, x):
    return self.w2(F.silu(self.w1(x)) * self.w3(x) * 2)


@pytest.mark.parametrize("forward", [_skip_up, _scale_product])
def test_class_forward_replaced_after_fuse_runs_unfused(forward):
    # A forward put on the class after fusing is code the analysis has not seen: each call runs
    # it as it is, and the members compute their own outputs.
    class Swapped(Mine):
        pass

    torch.manual_seed(0)
    plain = Swapped().double()
    fused = copy.deepcopy(plain)
    assert len(_gated(fuse(fused).report)) == 1
    x = torch.randn(3, H, dtype=torch.float64)
    assert torch.equal(fused(x), plain(x))
    Swapped.forward = forward
    assert torch.equal(fused(x), plain(x))


def test_t5_wo_kept_in_float32_is_refused_with_the_dtypes():
    """transformers keeps T5's ``wo`` in float32 (``_keep_in_fp32_modules``) when the model is
    loaded in bfloat16: one op cannot take both, and the report says which Linear has which."""
    model = _t5("gated-gelu").to(torch.bfloat16)
    for block in model.encoder.block:
        block.layer[-1].DenseReluDense.wo.float()
    _, report = fuse(model)
    assert not _gated(report), str(report)
    refused = [d for d in report.near_misses if d.layers[-1].endswith("DenseReluDense.wo")]
    assert len(refused) == 2, str(report)
    for d in refused:
        assert "wi_0: torch.bfloat16" in d.why and "wo: torch.float32" in d.why, d.why


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_t5_one_linear_cast_after_fuse_falls_back(dtype):
    """Of a fused float32 T5 layer's MLP, ``wo`` cast after fusing: T5's forward casts the
    product to wo's dtype, so the unfused MLP runs; the fused one computes module by module
    (the same bits, keeping what the unfused keeps). ``wi_0`` cast: the unfused MLP raises
    F.linear's error, and so does the fused one."""
    torch.manual_seed(0)
    model = _t5("gated-gelu")
    assert len(_gated(fuse(model).report)) == 2
    fused = model.encoder.block[0].layer[-1].DenseReluDense
    plain = copy.deepcopy(fused)
    unfuse(plain)
    assert type(plain.wo) is nn.Linear and type(fused.wo) is not nn.Linear
    x = torch.randn(2, 5, H)
    for m in (plain, fused):
        m.wo.to(dtype)
    for mode in (True, False):
        plain.train(mode)
        fused.train(mode)
        out = fused(x)
        assert out.dtype == dtype and torch.equal(out, plain(x))
    assert saved_activation_bytes(fused, x) == saved_activation_bytes(plain, x)
    for m in (plain, fused):
        m.wi_0.to(dtype)
    with pytest.raises(RuntimeError) as unfused_error:
        plain(x)
    with pytest.raises(RuntimeError) as fused_error:
        fused(x)
    assert str(fused_error.value) == str(unfused_error.value)


def test_vmap_over_a_batch_of_inputs():
    plain, fused, _ = _llama_mlp()
    fuse(fused)
    xs = torch.randn(4, 3, H, dtype=torch.float64)
    _close(torch.func.vmap(fused)(xs), torch.func.vmap(plain)(xs), "vmap")
    _close(torch.func.vmap(fused)(xs), plain(xs), "vmap against a batched call")


def test_checkpoint_of_a_fused_mlp():
    from torch.utils.checkpoint import checkpoint
    plain, fused, x = _llama_mlp()
    fuse(fused)
    x = x.requires_grad_()
    a = checkpoint(plain, x, use_reentrant=False)
    b = checkpoint(fused, x, use_reentrant=False)
    _close(b, a, "output")
    ga = torch.autograd.grad(a.square().sum(), [x] + list(plain.parameters()))
    gb = torch.autograd.grad(b.square().sum(), [x] + list(fused.parameters()))
    for name, r, g in zip(["x"] + [n for n, _ in plain.named_parameters()], ga, gb):
        _close(g, r, f"grad of {name}")


def test_fusing_a_fused_model_changes_nothing():
    torch.manual_seed(0)
    plain = transformers.LlamaModel(transformers.LlamaConfig(**_attn())).double()
    fused = copy.deepcopy(plain)
    _, first = fuse(fused)
    units = [d.layers for d in _gated(first)]
    assert len(units) == 2, str(first)
    modules = {name: (m, type(m), dict(vars(m))) for name, m in fused.named_modules()}
    _, again = fuse(fused)
    assert [(d.layers, d.action) for d in again.decisions if d.layers in units] == [
        (layers, "already fused") for layers in units], str(again)
    assert not any(d.action == "fused" for d in again.decisions), str(again)
    assert "already fused" in str(again)
    for name, m in fused.named_modules():
        was, kind, attributes = modules[name]
        assert m is was and type(m) is kind and dict(vars(m)) == attributes, name
    mlp = fused.layers[0].mlp
    assert mlp.gate_proj._ckpt_ext_run is mlp.down_proj._ckpt_ext_run
    _compare(plain, fused, (torch.randint(0, 50, (2, 5)),))


def _phi3_mlp():
    torch.manual_seed(0)
    from transformers.models.phi3.modeling_phi3 import Phi3MLP
    plain = Phi3MLP(transformers.Phi3Config(**_attn(pad_token_id=0))).double()
    return plain, copy.deepcopy(plain), torch.randn(2, 3, H, dtype=torch.float64)


@pytest.mark.parametrize("name", ["gate_up_proj", "down_proj"])
def test_packed_hook_after_fuse_sees_its_module_output(name):
    plain, fused, x = _phi3_mlp()
    assert len(_gated(fuse(fused).report)) == 1
    seen, want = [], []
    getattr(fused, name).register_forward_hook(lambda m, a, out: seen.append(out))
    getattr(plain, name).register_forward_hook(lambda m, a, out: want.append(out))
    assert torch.equal(fused(x), plain(x))
    assert len(seen) == len(want) == 1 and torch.equal(seen[0], want[0])


def test_owner_without_source_is_left_alone():
    # A class made by exec has no source to read: nothing says that tracing saw every statement.
    scope = {}
    exec("import torch.nn.functional as F\n"
         "def forward(self, x):\n"
         "    return self.w2(F.silu(self.w1(x)) * self.w3(x))\n", scope)
    NoSource = type("NoSource", (Mine,), {"forward": scope["forward"]})
    torch.manual_seed(0)
    plain = NoSource().double()
    fused = copy.deepcopy(plain)
    _, report = fuse(fused)
    assert not _gated(report), str(report)
    assert any("cannot be read" in d.why for d in report.near_misses), str(report)
    x = torch.randn(3, H, dtype=torch.float64)
    assert torch.equal(fused(x), plain(x))

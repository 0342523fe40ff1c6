"""Gated MLPs (``down(act(gate(x)) * up(x))``: SwiGLU, GeGLU) under plain ``fuse``: transformers'
Llama/Mistral/Qwen2/Gemma/Phi3 MLPs, T5's gated dense layer and hand-written ones fuse as one
``gated_mlp`` unit per layer; outputs and every gradient match an unfused deepcopy in float64,
train and eval; and every caller still gets what the unfused model computes (hooks, changed
settings, members on their own, pickle, compile, torch.func, statements fx did not record)."""
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
from _ecosys import saved_activation_bytes

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

H, I = 8, 16


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
    "t5 gated-gelu, dropout 0.1 in eval": lambda: _t5("gated-gelu", 0.1).eval(),
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
        a, b = _output(plain(*inputs)), _output(fused(*inputs))
        _close(b, a, f"output, train={mode}")
        ga = torch.autograd.grad(a.square().sum(), list(plain.parameters()), allow_unused=True)
        gb = torch.autograd.grad(b.square().sum(), list(fused.parameters()), allow_unused=True)
        for (name, _), x, y in zip(plain.named_parameters(), ga, gb):
            assert (x is None) == (y is None), name
            if x is not None:
                _close(y, x, f"grad of {name}, train={mode}", grad_rtol)


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
    # T5's embedding gradient (1e-5 where the others are near 1) is a sum of cancelling terms:
    # a 1-ulp difference of the gelu_tanh derivative shows there at 1e-10 of its largest value
    rtol = 1e-9 if name.startswith("t5") else 1e-14
    # with dropout p>0 a training call draws masks: test_t5_dropout_fused_in_eval_... compares it
    modes = (False,) if "dropout 0.1" in name else (True, False)
    _compare(plain, fused, (torch.randint(0, 50, (2, 5)),), rtol, modes)


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


def test_t5_dropout_in_training_is_left_alone_with_the_reason():
    model = _t5("gated-gelu", 0.1)
    _, report = fuse(model)
    assert not _gated(report), str(report)
    refused = [d for d in report.near_misses if "wo" in d.layers[-1]]
    assert len(refused) == 2 and all("dropout p>0" in d.why for d in refused), str(report)


def test_t5_dropout_fused_in_eval_falls_back_in_training():
    torch.manual_seed(0)
    plain = _t5("gated-gelu", 0.1).double().eval()
    fused = copy.deepcopy(plain)
    assert len(_gated(fuse(fused).report)) == 2
    plain.train()
    fused.train()
    ids = torch.randint(0, 50, (2, 5))
    torch.manual_seed(1)
    a = plain(ids).last_hidden_state
    torch.manual_seed(1)
    b = fused(ids).last_hidden_state
    _close(b, a, "training output with the same dropout masks")


def test_llama_generate_save_and_unfuse(tmp_path):
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_attn())).eval()
    fused = copy.deepcopy(plain)
    fuse(fused)
    assert isinstance(fused.model.layers[0].mlp.gate_proj, RunLinear)
    ids = torch.randint(1, 50, (1, 4))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(plain.generate(ids, **kw), fused.generate(ids, **kw))
    fused.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded.model.layers[0].mlp.gate_proj) is nn.Linear
    assert torch.equal(loaded(ids).logits, fused(ids).logits)
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


def test_compile_fullgraph_and_torch_func():
    plain, fused, x = _llama_mlp()
    fuse(fused)
    compiled = torch.compile(fused, fullgraph=True, backend="eager")
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
    assert any("statement fx did not record" in d.why for d in report.near_misses), str(report)
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

"""ckpt_ext.gated_mlp and ckpt_ext.mlp with ``lora=`` against peft's own LoRA modules (peft's
get_peft_model on transformers' LlamaMLP, Phi3MLP and GPT2MLP, from tiny configs): the op called
with the peft module's tensors computes what the module computes, with the same dropout masks
under the same seed, the same gradients, and keeps only its input where peft's modules keep every
activation. The call that turns a peft ``lora.Linear`` into a :class:`ckpt_ext.LoRA` is
``lora_of`` below."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import ckpt_ext
from _ecosys import saved_activation_bytes
from reference import measured, rel_err

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

# Relative bound of the output and every gradient: ~6x the largest measured over seeds 0-4
# (--seed-sweep=0:5, CKPT_EXT_MEASURE): float64 3.0e-16, float32 1.6e-7.
TOL = {torch.float64: 2e-15, torch.float32: 1e-6}


def lora_of(layer: nn.Module, adapter: str = "default") -> ckpt_ext.LoRA:
    """The ckpt_ext.LoRA of a peft ``lora.Linear``'s vanilla adapter: its lora_A and lora_B
    weights, lora_B's bias (``lora_bias=True``), its scaling, and the p of its dropout when the
    module is training (nn.Identity for ``lora_dropout=0``, and any Dropout in eval, draw none)."""
    drop = layer.lora_dropout[adapter]
    p = drop.p if isinstance(drop, nn.Dropout) and drop.training else 0.0
    return ckpt_ext.LoRA(layer.lora_A[adapter].weight, layer.lora_B[adapter].weight,
                         layer.scaling[adapter], layer.lora_B[adapter].bias, p)


def peft_unit(kind: str, dropout: float, lora_bias: bool, dtype):
    """(peft-wrapped unit, its inner module, the fused call on its tensors)."""
    from peft import LoraConfig, get_peft_model
    if kind == "llama":
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaMLP
        cfg = LlamaConfig(hidden_size=24, intermediate_size=56, num_attention_heads=2,
                          num_key_value_heads=2)
        unit, targets = LlamaMLP(cfg), ["gate_proj", "up_proj", "down_proj"]
    elif kind == "phi3":
        from transformers import Phi3Config
        from transformers.models.phi3.modeling_phi3 import Phi3MLP
        cfg = Phi3Config(hidden_size=24, intermediate_size=28, num_attention_heads=2,
                         num_key_value_heads=2)
        unit, targets = Phi3MLP(cfg), ["gate_up_proj", "down_proj"]
    else:
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
        cfg = GPT2Config(n_embd=24, n_head=2, resid_pdrop=0.0)
        unit, targets = GPT2MLP(42, cfg), ["c_fc", "c_proj"]
    config = LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=dropout,
                        lora_bias=lora_bias, init_lora_weights=False,
                        fan_in_fan_out=kind == "gpt2")
    model = get_peft_model(unit.to(dtype), config).train()
    m = model.base_model.model
    if kind == "llama":
        fused = lambda x: ckpt_ext.gated_mlp(
            x, m.gate_proj.base_layer.weight, m.up_proj.base_layer.weight,
            m.down_proj.base_layer.weight, activation="silu",
            lora=[lora_of(m.gate_proj), lora_of(m.up_proj), lora_of(m.down_proj)])
    elif kind == "phi3":
        fused = lambda x: ckpt_ext.gated_mlp(
            x, m.gate_up_proj.base_layer.weight, None, m.down_proj.base_layer.weight,
            activation="silu", lora=[lora_of(m.gate_up_proj), lora_of(m.down_proj)])
    else:  # Conv1D stores (in, out): the op takes weight.t(); gelu_new is "gelu_tanh"
        fc, proj = m.c_fc, m.c_proj
        fused = lambda x: ckpt_ext.mlp(
            x, [fc.base_layer.weight.t(), proj.base_layer.weight.t()],
            [fc.base_layer.bias, proj.base_layer.bias], "gelu_tanh", last_activation=False,
            lora=[lora_of(fc), lora_of(proj)])
    return model, fused


def outputs_and_grads(fn, model, x, gy, seed):
    """fn(x) under seed, its gradients w.r.t. x and the trainable parameters, and the generator's
    state after the forward and after the backward (other draws in between)."""
    torch.manual_seed(seed)
    x = x.detach().requires_grad_()
    y = fn(x)
    after = torch.get_rng_state()
    torch.rand(10)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(y, [x, *params], gy)
    return y.detach(), grads, after, torch.get_rng_state()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("lora_bias", [False, True], ids=["no_lora_bias", "lora_bias"])
@pytest.mark.parametrize("dropout", [0.0, 0.05])
@pytest.mark.parametrize("kind", ["llama", "phi3", "gpt2"])
def test_matches_the_peft_module(kind, dropout, lora_bias, dtype, seed):
    model, fused = peft_unit(kind, dropout, lora_bias, dtype)
    x = torch.randn(2, 5, 24, dtype=dtype)
    gy = torch.randn(2, 5, 24, dtype=dtype)
    y, grads, after, end = outputs_and_grads(fused, model, x, gy, seed)
    y_ref, grads_ref, after_ref, end_ref = outputs_and_grads(model, model, x, gy, seed)
    assert torch.equal(after, after_ref) and torch.equal(end, end_ref)
    names = ["out", "grad_x"] + [n for n, p in model.named_parameters() if p.requires_grad]
    for name, a, b in zip(names, [y, *grads], [y_ref, *grads_ref]):
        e = measured(f"lora_peft/{str(dtype)[6:]}/{kind}", rel_err(a, b))
        assert e <= TOL[dtype], f"{kind} {name}: rel err {e:.3g}"


@pytest.mark.parametrize("dropout", [0.0, 0.05])
@pytest.mark.parametrize("kind", ["llama", "phi3"])
def test_keeps_only_x_where_peft_keeps_the_activations(kind, dropout):
    # Bytes of the storages autograd saves (saved-tensor hooks), the model's parameters apart:
    # the fused op keeps x alone (and, with dropout, the generator state, which is no saved
    # tensor); peft's module keeps g, f(g), u, h and the rank-wide A-outputs (and the masks).
    model, fused = peft_unit(kind, dropout, False, torch.float32)
    x = torch.randn(4, 16, 24, requires_grad=True)
    kept_fused = saved_activation_bytes(model, x, run=fused)
    kept_peft = saved_activation_bytes(model, x)
    assert kept_fused == x.numel() * 4
    inter = 56 if kind == "llama" else 28
    assert kept_peft >= kept_fused + 4 * 64 * inter * 4, (kept_fused, kept_peft)

"""peft LoRA models of the fuse tests (peft over transformers models from tiny configs, nothing
downloaded): the issue's tiny Llama (hidden 64, intermediate 176, 2 layers, r=8 on all seven
projections), its 4-bit QLoRA form, and the measurements of a step: what the MLPs keep beyond
their input, unfused, and what the whole step keeps."""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from _ecosys import saved_activation_bytes

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKENS = (2, 64)  # one step on 2x64 tokens


def llama(dtype=torch.float32, layers: int = 2) -> nn.Module:
    import transformers as t
    cfg = t.LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=176,
                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, max_position_embeddings=128)
    torch.manual_seed(0)
    return t.LlamaModel(cfg).to(dtype)


def with_lora(model: nn.Module, dropout: float = 0.0, targets: Sequence[str] = LLAMA_TARGETS,
              r: int = 8, **config) -> nn.Module:
    """``get_peft_model`` with LoRA weights drawn at random (``init_lora_weights=False``: B is not
    zero, so every term counts), seeded."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(1)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), lora_dropout=dropout,
                     init_lora_weights=False, **config)
    return get_peft_model(model, cfg)


def ids(batch: int = TOKENS[0], seq: int = TOKENS[1]) -> torch.Tensor:
    torch.manual_seed(3)
    return torch.randint(1, 50, (batch, seq))


def output(out) -> torch.Tensor:
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out


def mlps(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    return [(p, m) for p, m in model.named_modules() if type(m).__name__.endswith("MLP")]


def mlp_kept_bytes(model: nn.Module, *inputs) -> Tuple[int, int]:
    """(bytes of the distinct storages autograd saves inside each MLP's call, less its input and
    the parameters; the rows of each MLP's input), unfused (its hooks count)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    state = {"input": None}
    saved: Dict[int, int] = {}
    rows: List[int] = []

    def pre(m, args):
        state["input"] = args[0].untyped_storage().data_ptr()
        rows.append(args[0].numel() // args[0].shape[-1])

    def post(m, args, out):
        state["input"] = None

    def pack(t):
        st = t.untyped_storage()
        if state["input"] is not None and st.data_ptr() not in params and \
                st.data_ptr() != state["input"]:
            saved[st.data_ptr()] = st.nbytes()
        return t

    handles = [h for _, m in mlps(model)
               for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(*inputs)
        del out
    finally:
        for h in handles:
            h.remove()
    assert len(set(rows)) == 1, rows
    return sum(saved.values()), rows[0]


def step_kept_bytes(model: nn.Module, *inputs) -> int:
    """Bytes of the distinct storages autograd saves for backward in the whole forward."""
    return saved_activation_bytes(model, *inputs, run=lambda *a: output(model(*a)))


def trainable(model: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def four_bit(model: nn.Module, skip: Sequence[str] = ()) -> nn.Module:
    """``model`` with every nn.Linear but those named in ``skip`` replaced by a bitsandbytes
    Linear4bit (nf4, float32 compute) holding its weight quantized, as QLoRA loads a model."""
    import bitsandbytes as bnb
    for path, m in list(model.named_modules()):
        for name, child in list(m.named_children()):
            if type(child) is nn.Linear and name not in skip:
                q = bnb.nn.Linear4bit(child.in_features, child.out_features,
                                      bias=child.bias is not None,
                                      compute_dtype=child.weight.dtype, quant_type="nf4")
                q.weight = bnb.nn.Params4bit(child.weight.data.clone(), requires_grad=False,
                                             quant_type="nf4")
                if child.bias is not None:
                    q.bias = nn.Parameter(child.bias.data.clone(), requires_grad=False)
                setattr(m, name, q.to(child.weight.device))
    model.is_loaded_in_4bit = True  # what transformers sets; peft then makes lora.bnb.Linear4bit
    return model


def freeze(model: nn.Module, but: Optional[str] = "lora_") -> nn.Module:
    for n, p in model.named_parameters():
        p.requires_grad_(but is not None and but in n)
    return model

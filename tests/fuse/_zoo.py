"""The model zoo of ``fuse``: transformers models from tiny configs (nothing downloaded) and
``nn.TransformerEncoderLayer``, each with where its MLPs start and end, and the measurements of
tests/fuse/test_fuse_zoo.py and scripts/zoo_table.py: what the MLPs keep for backward unfused,
what fusing frees, kept and peak bytes of a training step, fused against plain."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ckpt_ext import fuse
from ckpt_ext.memory import MemoryMeter
from _ecosys import saved_activation_bytes

H, I, V, S = 16, 64, 50, 7  # hidden, MLP width, vocabulary, sequence length


@dataclass
class ZooModel:
    make: Callable[[], nn.Module]       # float32, dropouts as configured
    inputs: Callable[[], tuple]         # seeded by the caller
    mlp: Tuple[str, str]                # path suffixes of each MLP's first and last Linear
    output: Callable[[object], torch.Tensor] = lambda out: out.last_hidden_state


def _tf():
    import transformers
    return transformers


def _ids():
    return (torch.randint(1, V, (2, S)),)


def _attn(**kw):
    return dict(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                max_position_embeddings=32, **kw)


def _t5(ff):
    t = _tf()
    return t.T5EncoderModel(t.T5Config(vocab_size=V, d_model=H, d_kv=8, d_ff=I, num_layers=2,
                                       num_heads=2, dropout_rate=0.1, feed_forward_proj=ff))


def _bart():
    t = _tf()
    return t.BartModel(t.BartConfig(vocab_size=V, d_model=H, encoder_layers=1, decoder_layers=1,
                                    encoder_attention_heads=2, decoder_attention_heads=2,
                                    encoder_ffn_dim=I, decoder_ffn_dim=I,
                                    max_position_embeddings=32))


def _whisper():
    t = _tf()
    return t.WhisperModel(t.WhisperConfig(vocab_size=V, d_model=H, encoder_layers=1,
                                          decoder_layers=1, encoder_attention_heads=2,
                                          decoder_attention_heads=2, encoder_ffn_dim=I,
                                          decoder_ffn_dim=I, num_mel_bins=8,
                                          max_source_positions=8, max_target_positions=16,
                                          pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                          decoder_start_token_id=1))


def _vision(kind):
    t = _tf()
    kw = dict(hidden_size=H, intermediate_size=I, num_hidden_layers=2, num_attention_heads=2,
              image_size=8, patch_size=4, num_channels=3)
    if kind == "vit":
        return t.ViTModel(t.ViTConfig(hidden_dropout_prob=0.1, **kw))
    return t.CLIPVisionModel(t.CLIPVisionConfig(**kw))


def _bert(cls_name, config_name, **kw):
    t = _tf()
    config = getattr(t, config_name)(vocab_size=V, hidden_size=H, intermediate_size=I,
                                     num_hidden_layers=2, num_attention_heads=2,
                                     max_position_embeddings=32, **kw)
    return getattr(t, cls_name)(config)


class _Encoder(nn.Module):
    """Two ``nn.TransformerEncoderLayer`` in a Sequential, as a user writing their own
    transformer builds it."""

    def __init__(self, norm_first):
        super().__init__()
        self.layers = nn.Sequential(*[nn.TransformerEncoderLayer(
            H, 2, dim_feedforward=I, dropout=0.1, batch_first=True, norm_first=norm_first)
            for _ in range(2)])

    def forward(self, x):
        return self.layers(x)


def _x():
    return (torch.randn(2, S, H),)


def _pixels():
    return (torch.randn(2, 3, 8, 8),)


def _whisper_inputs():
    return (torch.randn(2, 8, 16), torch.randint(1, V, (2, 5)))


def _whisper_call(m, feats, ids):
    return m(input_features=feats, decoder_input_ids=ids)


ZOO: Dict[str, ZooModel] = {
    "Llama": ZooModel(lambda: _tf().LlamaModel(_tf().LlamaConfig(**_attn())), _ids,
                      ("mlp.gate_proj", "mlp.down_proj")),
    "Mistral": ZooModel(lambda: _tf().MistralModel(_tf().MistralConfig(**_attn())), _ids,
                        ("mlp.gate_proj", "mlp.down_proj")),
    "Qwen2": ZooModel(lambda: _tf().Qwen2Model(_tf().Qwen2Config(**_attn())), _ids,
                      ("mlp.gate_proj", "mlp.down_proj")),
    "Gemma": ZooModel(lambda: _tf().GemmaModel(_tf().GemmaConfig(
        **_attn(hidden_activation="gelu_pytorch_tanh"))), _ids,
        ("mlp.gate_proj", "mlp.down_proj")),
    "Phi-3": ZooModel(lambda: _tf().Phi3Model(_tf().Phi3Config(**_attn(pad_token_id=0))), _ids,
                      ("mlp.gate_up_proj", "mlp.down_proj")),
    "T5 relu, dropout 0.1": ZooModel(lambda: _t5("relu"), _ids,
                                     ("DenseReluDense.wi", "DenseReluDense.wo")),
    "T5 gated-gelu, dropout 0.1": ZooModel(lambda: _t5("gated-gelu"), _ids,
                                           ("DenseReluDense.wi_0", "DenseReluDense.wo")),
    "GPT-2": ZooModel(lambda: _tf().GPT2Model(_tf().GPT2Config(
        vocab_size=V, n_positions=32, n_embd=H, n_inner=I, n_layer=2, n_head=2)), _ids,
        ("mlp.c_fc", "mlp.c_proj")),
    "GPT-NeoX": ZooModel(lambda: _tf().GPTNeoXModel(_tf().GPTNeoXConfig(
        vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=32, hidden_dropout=0.1)), _ids,
        ("mlp.dense_h_to_4h", "mlp.dense_4h_to_h")),
    "OPT": ZooModel(lambda: _tf().OPTModel(_tf().OPTConfig(
        vocab_size=V, hidden_size=H, ffn_dim=I, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=32, word_embed_proj_dim=H)), _ids, ("fc1", "fc2")),
    "Bart": ZooModel(_bart, _ids, ("fc1", "fc2")),
    "Whisper": ZooModel(_whisper, _whisper_inputs, ("fc1", "fc2")),
    "ViT": ZooModel(lambda: _vision("vit"), _pixels, ("mlp.fc1", "mlp.fc2")),
    "CLIPVision": ZooModel(lambda: _vision("clip"), _pixels, ("mlp.fc1", "mlp.fc2")),
    "BERT": ZooModel(lambda: _bert("BertModel", "BertConfig"), _ids,
                     ("intermediate.dense", "output.dense")),
    "DistilBERT": ZooModel(lambda: _tf().DistilBertModel(_tf().DistilBertConfig(
        vocab_size=V, dim=H, hidden_dim=I, n_layers=2, n_heads=2, max_position_embeddings=32)),
        _ids, ("ffn.lin1", "ffn.lin2")),
    "RoBERTa": ZooModel(lambda: _bert("RobertaModel", "RobertaConfig", pad_token_id=0), _ids,
                        ("intermediate.dense", "output.dense")),
    "nn.TransformerEncoderLayer": ZooModel(lambda: _Encoder(False), _x,
                                           ("linear1", "linear2"), lambda out: out),
    "nn.TransformerEncoderLayer, norm_first": ZooModel(lambda: _Encoder(True), _x,
                                                       ("linear1", "linear2"), lambda out: out),
}


#: The zoo models measured with peft LoRA too (the table's LoRA column): the modules peft targets
#: (every Linear of attention and MLP, as people fine-tune), r=8, dropout 0, bases frozen.
LORA: Dict[str, Tuple[str, ...]] = {
    "Llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "Qwen2": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "Phi-3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    "GPT-2": ("c_attn", "c_proj", "c_fc"),
    "BERT": ("query", "key", "value", "dense"),
    "ViT": ("query", "key", "value", "dense", "fc1", "fc2"),
    "CLIPVision": ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
    "nn.TransformerEncoderLayer": ("linear1", "linear2"),
}


def make(name: str, lora: bool = False) -> nn.Module:
    """The zoo model, float32; with ``lora``, wrapped by peft's get_peft_model (LoRA weights drawn
    seeded, B not zero)."""
    model = ZOO[name].make()
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(11)
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=list(LORA[name]), lora_dropout=0.0,
                     init_lora_weights=False, fan_in_fan_out=name == "GPT-2")
    return get_peft_model(model, cfg)


def call(name: str, model: nn.Module, inputs: tuple):
    """The model's output tensor for ``inputs``."""
    z = ZOO[name]
    out = _whisper_call(model, *inputs) if name == "Whisper" else model(*inputs)
    return z.output(out)


def mlp_spans(name: str, model: nn.Module) -> List[Tuple[nn.Module, nn.Module]]:
    """(first Linear, last Linear) of each MLP of the model, in module order."""
    first, last = ZOO[name].mlp
    mods = dict(model.named_modules())
    out = []
    for path, m in mods.items():
        if path == first or path.endswith("." + first):
            prefix = path[:len(path) - len(first)]
            out.append((m, mods[prefix + last]))
    return out


def mlp_kept_bytes(name: str, model: nn.Module, inputs: tuple) -> Tuple[int, Dict[str, int]]:
    """Bytes of the distinct storages autograd saves between each MLP's first Linear's call and
    its last Linear's return, less the MLP's input and the parameters: what the MLPs keep for
    backward beyond their input, unfused (``model`` must be unfused: its hooks count); and the
    rows each first Linear took, by its path."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    paths = {id(m): p for p, m in model.named_modules()}
    state = {"inside": False, "input": None}
    saved: Dict[int, int] = {}
    rows: Dict[str, int] = {}

    def pre(m, args):
        state["inside"], state["input"] = True, args[0].untyped_storage().data_ptr()
        rows[paths[id(m)]] = args[0].numel() // args[0].shape[-1]

    def post(m, args, out):
        state["inside"] = False

    def pack(t):
        st = t.untyped_storage()
        if state["inside"] and st.data_ptr() not in params and st.data_ptr() != state["input"]:
            saved[st.data_ptr()] = st.nbytes()
        return t

    handles = []
    for first, last in mlp_spans(name, model):
        handles.append(first.register_forward_pre_hook(pre))
        handles.append(last.register_forward_hook(post))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = call(name, model, inputs)
        del out
    finally:
        for h in handles:
            h.remove()
    return sum(saved.values()), rows


def saved_bytes(name: str, model: nn.Module, inputs: tuple) -> int:
    """Bytes of the distinct storages autograd saves for backward, parameters not counted."""
    return saved_activation_bytes(model, *inputs, run=lambda *a: call(name, model, a))


def peak_bytes(name: str, model: nn.Module, inputs: tuple) -> int:
    """Peak CPU bytes above the start of one training step (forward, ``.square().mean()``,
    backward), by ckpt_ext's allocator meter."""
    for p in model.parameters():
        p.grad = None
    with MemoryMeter("cpu") as meter:
        start = meter.current()
        meter.reset_peak()
        call(name, model, inputs).square().mean().backward()
        peak = meter.peak() - start
    for p in model.parameters():
        p.grad = None
    return peak


@dataclass
class Row:
    name: str
    units: int            # decisions fused on the MLPs' Linears
    mlps: int
    mlp_kept: int         # bytes the MLPs keep beyond their input, unfused
    freed: int            # saved bytes of the whole model, plain less fused
    claimed: int          # what the report's fused MLP decisions say they free, for these rows
    kept: Tuple[int, int]  # saved bytes, plain and fused
    peak: Tuple[int, int]  # peak bytes of a step, plain and fused
    why: str              # why an MLP is left alone, from the report; "" when all are fused

    @property
    def share(self) -> float:
        return self.freed / self.mlp_kept if self.mlp_kept else 0.0


def measure(name: str, lora: bool = False) -> Tuple[Row, nn.Module, nn.Module]:
    """One zoo model, float32 in training (with peft LoRA: :func:`make`): its row, and the plain
    model and the fused copy."""
    torch.manual_seed(0)
    plain = make(name, lora).train()
    fused = copy.deepcopy(plain)
    _, report = fuse(fused)
    spans = mlp_spans(name, fused)
    paths = {id(m): p for p, m in fused.named_modules()}
    firsts = {paths[id(f)] for f, _ in spans}
    units = sum(1 for d in report.fused if any(lay in firsts for lay in d.layers))
    whys = [d.why for d in report.decisions if d.action != "fused" and firsts & set(d.layers)]
    whys += [w for p, w in report.other_layers if p in firsts]
    why = "; ".join(dict.fromkeys(whys))
    torch.manual_seed(1)
    inputs = ZOO[name].inputs()
    torch.manual_seed(2)
    mlp_kept, rows = mlp_kept_bytes(name, plain, inputs)
    claimed = sum(d.bytes_per_row * rows[d.layers[0]] for d in report.fused
                  if d.layers[0] in firsts)
    torch.manual_seed(2)
    kept_plain = saved_bytes(name, plain, inputs)
    torch.manual_seed(2)
    kept_fused = saved_bytes(name, fused, inputs)
    torch.manual_seed(2)
    peak_plain = peak_bytes(name, plain, inputs)
    torch.manual_seed(2)
    peak_fused = peak_bytes(name, fused, inputs)
    row = Row(name, units, len(spans), mlp_kept, kept_plain - kept_fused, claimed,
              (kept_plain, kept_fused), (peak_plain, peak_fused), why if units < len(spans) else "")
    return row, plain, fused


def table(rows: List[Row], lora: Dict[str, Row]) -> str:
    """The markdown table of docs/fuse-usage.md; ``lora``: the rows measured with peft LoRA."""
    lines = ["| model | MLPs fused | MLP kept, unfused | freed | kept for backward, plain → fused "
             "| peak of a step, plain → fused | with LoRA: MLPs fused, MLP kept, freed "
             "| why an MLP is left alone |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        k = lora.get(r.name)
        with_lora = f"{k.units}/{k.mlps}, {k.mlp_kept:,} B, {k.share:.0%}" if k else "—"
        lines.append(f"| {r.name} | {r.units}/{r.mlps} | {r.mlp_kept:,} B | {r.share:.0%} | "
                     f"{r.kept[0]:,} → {r.kept[1]:,} B | {r.peak[0]:,} → {r.peak[1]:,} B | "
                     f"{with_lora} | {r.why.replace('|', '/') or '—'} |")
    return "\n".join(lines)


def within(limit: Optional[float] = None) -> Callable[[Row], bool]:
    return lambda r: r.share >= (0.9 if limit is None else limit)

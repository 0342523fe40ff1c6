"""What a benchmark run covers: the size presets, the modes compared, and the run's configuration.

Sizes are (batch, in_features, hidden, depth) for chain/residual/mlp, (points, hidden, depth) for the
physics-informed networks, (tokens, depth) for bert-mlp, (tokens, hidden size, intermediate size,
depth) for llama-mlp, llama-lora and llama-lora-dropout, and (tokens, hidden size, expert
intermediate size, depth) for moe; the method behind each preset is in docs/benchmark.md.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

import torch

from ..models import NETWORKS, BertMLPNet, LlamaLoRANet, LlamaMLPNet, MoENet, is_pinn

#: The physics-informed networks of every preset but tiny: 2 -> 64x4 -> 1 on 4096 points.
PINN_SIZES = dict(batch=4096, hidden=64, depth=4)
#: bert-mlp's widths in every preset, BERT-base's: 768 -> 3072 -> 768.
BERT_WIDTHS = dict(in_features=768, hidden=3072)

PRESETS = {
    # Seconds: for tests and a first look.
    "tiny": dict(batch=16, in_features=32, hidden=64, depth=3, steps=3, warmup=1, budget="8MiB",
                 pinn=dict(batch=64, hidden=16, depth=3),
                 bert=dict(batch=16, depth=2, budget="128MiB"),
                 llama=dict(batch=16, in_features=32, hidden=88, depth=2, budget="8MiB"),
                 moe=dict(batch=16, in_features=32, hidden=32, depth=2, budget="8MiB")),
    # The small-layer regime of RL policies and physics-informed nets: per-op overheads (Python,
    # autograd nodes, allocations) weigh as much as the GEMMs. Steps are short, so take many.
    # bert-mlp: 4 sequences of 128 tokens.
    # llama-mlp: 512 tokens, hidden 256, intermediate 704 (Llama's 2.75 ratio).
    # moe (every preset): llama-mlp's hidden size, and each expert's intermediate size the same:
    # at cpu-default plain's step then takes as long as llama-mlp's (measured on a 2-core Xeon:
    # 1009 against 995 ms; at half llama-mlp's intermediate size, the same GEMM work, 1.4x).
    "small": dict(batch=2048, in_features=64, hidden=64, depth=4, steps=41, warmup=3,
                  budget="64MiB", pinn=PINN_SIZES, bert=dict(batch=512, depth=2, budget="256MiB"),
                  llama=dict(batch=512, in_features=256, hidden=704, depth=2, budget="64MiB"),
                  moe=dict(batch=512, in_features=256, hidden=256, depth=2, budget="128MiB")),
    # A wide batch and a narrow hidden size, so that activations (batch x hidden) outweigh the
    # weights, as they do in training at scale; with hidden >> batch the weights and their
    # gradients fill the peak whatever the mode. GEMMs dominate the step here.
    # bert-mlp: 16 sequences of 128 tokens. llama-mlp: 2048 tokens, hidden 1024, intermediate 2816.
    "cpu-default": dict(batch=1024, in_features=1024, hidden=512, depth=3, steps=15, warmup=2,
                        budget="512MiB", pinn=PINN_SIZES,
                        bert=dict(batch=2048, depth=3, budget="1GiB"),
                        llama=dict(batch=2048, in_features=1024, hidden=2816, depth=3,
                                   budget="1GiB"),
                        moe=dict(batch=2048, in_features=1024, hidden=1024, depth=3,
                                 budget="2GiB")),
    # The write-up: input (512, 1024), linear1 1024 -> 10240, three 10240 x 10240 blocks.
    # bert-mlp: 64 sequences of 128 tokens. llama-mlp: Llama-2-7B's widths, 8192 tokens.
    "writeup": dict(batch=512, in_features=1024, hidden=10240, depth=3, steps=15, warmup=3,
                    budget="40GiB", pinn=PINN_SIZES,
                    bert=dict(batch=8192, depth=4, budget="40GiB"),
                    llama=dict(batch=8192, in_features=4096, hidden=11008, depth=2,
                               budget="40GiB"),
                    moe=dict(batch=8192, in_features=4096, hidden=4096, depth=2,
                             budget="40GiB")),
}


@dataclass(frozen=True)
class Mode:
    model_mode: str  #: the mode the model is built in (ckpt_ext.models)
    compiled: bool = False
    reentrant: bool = False
    doc: str = ""


MODES = {
    "plain": Mode("plain", doc="stock PyTorch"),
    "checkpoint": Mode("checkpoint", doc="torch.utils.checkpoint (non-reentrant): chain "
                       "block1..block{depth-1} (the write-up), every block elsewhere"),
    "checkpoint-stack": Mode("checkpoint-stack", doc="chain: block1..block{depth} as one "
                             "checkpoint"),
    "compile": Mode("plain", compiled=True, doc="torch.compile of plain"),
    "compile-checkpoint": Mode("checkpoint-stack", compiled=True,
                               doc="torch.compile of checkpoint-stack (chain) / checkpoint"),
    "fused": Mode("fused", doc="ckpt_ext: chain one tanh_mlp over the blocks, residual "
                  "FusedLinearTanh per block, mlp FusedTanhMLP per block, bert-mlp FusedMLP (gelu) "
                  "per block, llama-mlp FusedGatedMLP per block, each physics-informed network "
                  "one FusedMLP of its activation"),
    "compile-fused": Mode("fused", compiled=True, doc="torch.compile of fused"),
    "liger": Mode("liger", doc="llama-mlp and the LoRA networks: Liger-Kernel's policy (gate "
                  "and up kept, the product recomputed; a custom Function in plain torch)"),
    "unsloth": Mode("unsloth", doc="llama-lora only: Unsloth's LoRA MLP policy (x, gate and up "
                    "kept, no GEMM of the base weights recomputed; a custom Function in plain "
                    "torch)"),
    "checkpoint-fused": Mode("checkpoint-fused", doc="llama-lora, llama-lora-dropout: "
                             "checkpoint of each fused MLP"),
    "checkpoint-reentrant": Mode("checkpoint", reentrant=True,
                                 doc="torch.utils.checkpoint(use_reentrant=True), as checkpoint"),
}
#: Reentrant checkpoint runs only when named: PyTorch recommends the non-reentrant variant, which
#: keeps the same bytes, peaks no higher, and alone supports torch.autograd.grad.
DEFAULT_MODES = [m for m in MODES if m != "checkpoint-reentrant"]
#: What a run without --full measures: the modes of the README's figures (fused against plain,
#: stock checkpoint and its compiled form) on its networks but those whose second-long steps
#: would multiply the run (make bench: a few minutes); --full: every network in DEFAULT_MODES.
HEADLINE_MODES = ["plain", "checkpoint", "checkpoint-stack", "fused", "compile-checkpoint"]
HEADLINE_NETWORKS = [n for n in NETWORKS if n not in ("bert-mlp", "llama-mlp", "llama-lora",
                                                      "llama-lora-dropout", "moe")]

# Rows a network does not run because another row is the same thing: checkpoint-stack where the
# network's checkpoint mode already covers the stack; Unsloth's policy where Unsloth runs peft's
# own forward, at LoRA dropout above 0.
SAME_AS = {
    (name, "checkpoint-stack"): ("checkpoint", "the whole MLP is already one checkpoint"
                                 if is_pinn(name) else "every block is already checkpointed")
    for name, cls in NETWORKS.items() if "checkpoint-stack" not in cls.MODES}
SAME_AS.update({(name, "unsloth"): ("plain", "Unsloth runs peft's forward at lora_dropout > 0")
                for name, cls in NETWORKS.items()
                if issubclass(cls, LlamaLoRANet) and cls.DROPOUT > 0})

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}

#: The write-up's four points of a step, in order.
READINGS = ("before forward", "after forward", "after loss", "after backward")


def model_mode(net_name: str, mode: str) -> str:
    """The ckpt_ext.models mode that bench ``mode`` builds for network ``net_name``."""
    m = MODES[mode].model_mode
    if m not in NETWORKS[net_name].MODES and m == "checkpoint-stack":
        return "checkpoint"  # compile-checkpoint where the checkpoint already covers the stack
    return m


def parse_bytes(s: str) -> int:
    """'512MiB', '40GiB', '1.5GB', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", s, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"budget must look like 512MiB, 40GiB or a byte count, "
                                         f"got {s!r}")
    value, unit, binary = m.groups()
    power = "KMGT".find(unit.upper()) + 1 if unit else 0
    return int(float(value) * (1024 if binary or not unit else 1000) ** power)


@dataclass
class Sizes:
    batch: int
    in_features: int
    hidden: int
    depth: int


def size_group(net_name: str) -> str:
    """Which of a preset's sizes network ``net_name`` takes: "pinn" (the physics-informed
    networks), "bert" (bert-mlp), "llama" (llama-mlp and the LoRA networks on its shapes), "moe"
    or "sizes" (chain, residual, mlp)."""
    cls = NETWORKS[net_name]
    if is_pinn(net_name):
        return "pinn"
    if issubclass(cls, (LlamaMLPNet, LlamaLoRANet)):
        return "llama"
    if issubclass(cls, MoENet):
        return "moe"
    return "bert" if issubclass(cls, BertMLPNet) else "sizes"


def runs_mode(net_name: str, mode: str) -> bool:
    """Whether network ``net_name`` has bench ``mode`` at all (liger: llama-mlp only)."""
    return model_mode(net_name, mode) in NETWORKS[net_name].MODES or \
        (net_name, mode) in SAME_AS


def sizes_in(conditions: dict, net_name: str) -> dict:
    """Network ``net_name``'s sizes in a results dict's ``conditions``."""
    return conditions[{"sizes": "sizes", "pinn": "pinn_sizes", "bert": "bert_sizes",
                       "llama": "llama_sizes", "moe": "moe_sizes"}[size_group(net_name)]]


@dataclass
class Config:
    device: torch.device
    dtype: torch.dtype
    preset: str
    sizes: Sizes  #: chain, residual, mlp
    pinn: Sizes
    bert: Sizes
    steps: int
    warmup: int
    budget: int  #: bytes, every network but bert-mlp
    bert_budget: int
    networks: list[str]
    modes: list[str]
    out: str
    compile_backend: str = "inductor"
    seed: int = 0
    progress: bool = True
    command: str = ""
    ratio: int = 4  #: MLP inner width / hidden
    llama: Sizes = None  #: llama-mlp, llama-lora: tokens, hidden size, intermediate size, depth
    llama_budget: int = 0
    moe: Sizes = None  #: moe: tokens, hidden size, expert intermediate size, depth
    moe_budget: int = 0
    section: str = "main"  #: "main" or "plan" (ckpt_ext.bench.plan_section)
    plan_methods: list = None  #: the plan section's methods besides the plan

    def sizes_of(self, net_name: str) -> Sizes:
        return getattr(self, size_group(net_name))

    def budget_of(self, net_name: str) -> int:
        group = size_group(net_name)
        return {"bert": self.bert_budget, "llama": self.llama_budget,
                "moe": self.moe_budget}.get(group, self.budget)

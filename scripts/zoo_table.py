"""Measures the zoo of tests/fuse/_zoo.py and writes its tables into docs/fuse-usage.md, between
the markers of its "The zoo" section and of its mixtures of experts (or prints them with --print).
Each row: a model from a tiny config, float32 in training, one step of 2 sequences; what its MLPs
(or experts modules) keep for backward beyond their input unfused; the share of that `fuse` frees;
the bytes autograd keeps and the step's peak, plain and fused (ckpt_ext's CPU meters); the same
with peft LoRA on the model (where listed); why its MLPs are left alone, from the report. A MoE
row names the experts implementation measured and the report's bytes per token.

    .venv/bin/python scripts/zoo_table.py [--print]
"""
from __future__ import annotations

import os
import sys
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "fuse-usage.md")
BEGIN = "<!-- zoo table: written by scripts/zoo_table.py -->"
END = "<!-- end of zoo table -->"
MOE_BEGIN = "<!-- moe table: written by scripts/zoo_table.py -->"
MOE_END = "<!-- end of moe table -->"


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path[:0] = [os.path.join(ROOT, "tests", "fuse"), os.path.join(ROOT, "tests")]
    import peft
    import transformers
    import _zoo

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    rows = [_zoo.measure(name)[0] for name in _zoo.ZOO]
    lora = {name: _zoo.measure(name, lora=True)[0] for name in _zoo.LORA}
    conditions = (f"torch {torch.__version__}, transformers {transformers.__version__}, CPU, "
                  f"float32, train(); hidden {_zoo.H}, MLP width {_zoo.I}, 2 layers (Bart, "
                  f"Whisper: 1 encoder and 1 decoder layer), 2 sequences of {_zoo.S} tokens "
                  f"(ViT, CLIP: 8x8 images of 4x4 patches; Whisper: 8 mel bins x 16 frames). "
                  f"With LoRA: peft {peft.__version__}, get_peft_model with r=8, dropout 0, on "
                  f"every Linear of attention and MLP, the bases frozen.")
    text = "\n".join([BEGIN, "", _zoo.table(rows, lora), "", conditions, "", END])
    moe = [_zoo.measure_moe(name, implementation)[0] for name in _zoo.MOE
           for implementation in _zoo.MOE_IMPLEMENTATIONS]
    moe_conditions = (f"torch {torch.__version__}, transformers {transformers.__version__}, CPU, "
                      f"float32, train(); hidden {_zoo.MOE_H}, expert width {_zoo.MOE_I}, "
                      f"{_zoo.MOE_E} experts, top-{_zoo.MOE_K}, 2 layers, 2 sequences of "
                      f"{_zoo.S} tokens; config._experts_implementation as the row names.")
    moe_text = "\n".join([MOE_BEGIN, "", _zoo.moe_table(moe), "", moe_conditions, "", MOE_END])
    if "--print" in sys.argv:
        print(text + "\n\n" + moe_text)
        return
    doc = open(DOC, encoding="utf-8").read()
    for begin, end, block in ((BEGIN, END, text), (MOE_BEGIN, MOE_END, moe_text)):
        if begin not in doc or end not in doc:
            sys.exit(f"{DOC}: the markers {begin!r} and {end!r} are missing")
        head, rest = doc.split(begin, 1)
        doc = head + block + rest.split(end, 1)[1]
    with open(DOC, "w", encoding="utf-8") as f:
        f.write(doc)
    print(f"wrote the zoo tables ({len(rows)} models, {len(moe)} MoE rows) into {DOC}")


if __name__ == "__main__":
    main()

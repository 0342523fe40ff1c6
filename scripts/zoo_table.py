"""Measures the zoo of tests/fuse/_zoo.py and writes its table into docs/fuse-usage.md, between
the markers of its "The zoo" section (or prints it with --print). Each row: a model from a tiny
config, float32 in training, one step of 2 sequences; what its MLPs keep for backward beyond
their input unfused; the share of that `fuse` frees; the bytes autograd keeps and the step's peak,
plain and fused (ckpt_ext's CPU meters); the same with peft LoRA on the model (where listed);
why its MLPs are left alone, from the report.

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
    if "--print" in sys.argv:
        print(text)
        return
    doc = open(DOC, encoding="utf-8").read()
    if BEGIN not in doc or END not in doc:
        sys.exit(f"{DOC}: the markers {BEGIN!r} and {END!r} are missing")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(DOC, "w", encoding="utf-8") as f:
        f.write(head + text + tail)
    print(f"wrote the zoo table ({len(rows)} models) into {DOC}")


if __name__ == "__main__":
    main()

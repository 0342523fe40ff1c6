"""scripts/convert_switches.py: the switch counts docs/converter.md shows are the script's, written
between its markers, never by hand."""
import os
import re
import runpy
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "convert_switches.py")
DOC = os.path.join(ROOT, "docs", "converter.md")


@pytest.fixture(scope="module")
def script():
    if not (os.path.exists(SCRIPT) and os.path.exists(DOC)):
        pytest.skip("scripts/ and docs/ are not beside these tests")
    return runpy.run_path(SCRIPT, run_name="convert_switches_under_test")


def test_docs_show_the_scripts_counts(script):
    with open(DOC) as f:
        text = f.read()
    shown = text[text.index(script["BEGIN"]) + len(script["BEGIN"]):text.index(script["END"])]
    where = re.search(r"Python (\d+\.\d+), torch ([\w.]+):", shown)
    here = (f"{sys.version_info[0]}.{sys.version_info[1]}", torch.__version__.split("+")[0])
    if where is None or where.groups() != here:
        pytest.skip(f"the docs' counts are for Python/torch {where and where.groups()}, not {here}")
    assert script["replace"](text, script["block"](script["counts"]())) == text, \
        "run: python scripts/convert_switches.py --write docs/converter.md"

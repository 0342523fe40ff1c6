"""README.md and docs/*.md: every relative link names a file of the tree and, with a #fragment, a
heading of that file (GitHub's anchors); the README stays a front door (at most 250 lines); no
history talk in the docs or the code (git log keeps history)."""
from __future__ import annotations

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _pages():
    docs = os.path.join(ROOT, "docs")
    if not os.path.isdir(docs):
        pytest.skip("docs/ is not beside these tests (tests copied out of the source tree)")
    return [os.path.join(ROOT, "README.md")] + sorted(
        os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))


def _anchors(path):
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats
    numbered."""
    seen, out = {}, set()
    in_code = False
    for line in open(path, encoding="utf-8"):
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_relative_link_resolves():
    broken = []
    for page in _pages():
        text = open(page, encoding="utf-8").read()
        text = re.sub(r"```.*?```", "", text, flags=re.S)  # links inside code blocks are code
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, frag = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            rel = os.path.relpath(page, ROOT)
            if not os.path.exists(dest):
                broken.append(f"{rel}: {target} (no such file)")
            elif frag and dest.endswith(".md") and frag not in _anchors(dest):
                broken.append(f"{rel}: {target} (no heading #{frag})")
    assert not broken, "\n".join(broken)


def test_readme_is_a_front_door():
    n = sum(1 for _ in open(os.path.join(ROOT, "README.md"), encoding="utf-8"))
    assert n <= 250, f"README.md has {n} lines; depth belongs in docs/"


def test_no_history_talk_in_the_tree():
    _pages()
    pattern = r"issue [0-9]+|first version|before the fix|as before|previous build"
    proc = subprocess.run(["grep", "-rniE", pattern, "ckpt_ext", "csrc", "README.md", "docs"],
                          cwd=ROOT, capture_output=True, text=True)
    hits = [line for line in proc.stdout.splitlines() if "__pycache__" not in line]
    assert not hits, "\n".join(hits[:20])

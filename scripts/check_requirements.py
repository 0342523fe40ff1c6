"""Exit 0 when every requirement of a requirements file is installed at a matching version in
this interpreter, 1 otherwise (listing what is missing). Uses installed metadata only, never the
network: scripts/setup.sh runs it to skip pip when everything is there, so `make test` and
`make bench` work offline once set up.

    python scripts/check_requirements.py requirements.txt
"""
from __future__ import annotations

import importlib.metadata
import sys

try:
    from packaging.requirements import InvalidRequirement, Requirement
except ImportError:  # packaging is not always installed; pip always vendors it
    from pip._vendor.packaging.requirements import InvalidRequirement, Requirement


def unmet(path: str) -> list[str]:
    problems = []
    for raw in open(path):
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith(("#", "-")):  # comments, pip options (-r, --index-url)
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement as e:
            problems.append(f"{line}: cannot parse ({e})")
            continue
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{req.name}: not installed")
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            problems.append(f"{req.name}: {version} installed, {req.specifier} required")
    return problems


if __name__ == "__main__":
    problems = unmet(sys.argv[1] if len(sys.argv) > 1 else "requirements.txt")
    for p in problems:
        print(p)
    sys.exit(1 if problems else 0)

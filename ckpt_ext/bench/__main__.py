"""``python -m ckpt_ext.bench``: see ``--help`` and docs/benchmark.md."""
import sys

from .cli import main

sys.exit(main())

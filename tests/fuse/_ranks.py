"""Two gloo ranks on localhost, launched by a test: ``spawn`` runs ``main(rank, store_file,
out_dir, *args)`` in each and returns their results; a rank's main ends with ``finish``, which
writes its result (any exception inside the rank becomes its ``error``, which fails the test) and
leaves. The ranks meet through a file (init_method file://, a FileStore), not a TCP port: no port
is picked, released and hoped to be free again while another process could take it."""
from __future__ import annotations

import json
import os
import sys
from typing import Callable, List

WORLD = 2


def finish(result: dict, out_dir: str, rank: int) -> None:
    """Write ``result`` and leave the rank."""
    import torch.distributed as dist
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if dist.is_initialized():
        # Both ranks finish their collectives before either tears gloo down; without the barrier
        # a rank could destroy the group under the other's gloo threads ("terminate called
        # without an active exception", SIGABRT).
        dist.barrier()
        dist.destroy_process_group()
    # Leave without the interpreter's teardown. About 1 run in 10, a gloo/c10d background thread
    # still joinable when static destructors run aborts the process at exit (SIGABRT) after all
    # work and the result file are done; the verdict is in the result file.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(main: Callable, out_dir, *args, check: bool = True) -> List[dict]:
    """Each rank's result of ``main``; with ``check``, a rank that failed fails the caller with
    its traceback. ``out_dir`` must be fresh per launch (a FileStore must start empty)."""
    import torch.multiprocessing as mp
    mp.spawn(main, args=(str(out_dir / "store"), str(out_dir)) + args, nprocs=WORLD, join=True)
    results = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]
    if check:
        for r in results:
            assert r["ok"], r.get("error")
    return results

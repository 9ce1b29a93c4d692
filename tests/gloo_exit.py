"""How a gloo test worker (tests/*_worker.py, run by torch.distributed.run) ends: every rank done, the process group
torn down, then the process leaves without the interpreter's and C++'s exit-time teardown. A rank aborted in two CI
runs with 'terminate called without an active exception' (std::terminate: a joinable thread destroyed, which is
what exit-time teardown does to threads left running), and torch.distributed.run reported the worker failed; the
barrier before the teardown alone did not prevent it."""
import os
import sys

import torch.distributed as dist


def leave() -> None:
    dist.barrier()  # every rank done before any tears its connections down (gloo aborts otherwise)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""The end of a distributed run: every rank done, the process group destroyed and its threads joined
before Python exits.

``destroy_process_group`` alone is not enough under gloo: gloo's shutdown is a no-op, so its worker
threads live as long as the group object, and the DDP wrappers of finished trainers (garbage in
reference cycles) keep that alive into interpreter shutdown. A worker that drops a finished
collective's tensors then needs the GIL to free their Python objects, and taking the GIL during
shutdown ends the thread by unwinding it, which aborts the process ("terminate called without an
active exception", SIGABRT) after the run's work is done; a loaded machine widens the window.
"""

from __future__ import annotations

import gc

import torch

__all__ = ["end_distributed"]


def end_distributed() -> None:
    """Wait for every rank, destroy the process group, and free it here, joining its threads.

    Call it once, at the end of a script, after the trainers are out of scope (their DDP wrappers
    hold the group): the garbage collection frees those while this function still holds the group,
    so the group's destructor runs at ``del``, whose binding releases the GIL, letting a worker that
    still needs the GIL finish before it is joined. A no-op without a process group.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    torch.distributed.barrier()
    group = torch.distributed.group.WORLD
    torch.distributed.destroy_process_group()
    gc.collect()  # the finished trainers' DDP wrappers and reducers; ``group`` keeps the group itself
    del group  # the last reference: the destructor joins gloo's worker threads, GIL released

"""Training runs in parallel worker processes (``polyattn demo``, ``polyattn sweep --workers``): spawned, so
CUDA works in each (all of them share the visible GPUs), one CPU thread each, and gone with the main process."""

import os
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context

import torch


def exit_with_parent(parent):
    """Exit once `parent` is gone: a main process killed on its own (a time limit's SIGKILL) leaves no
    worker training on, or idle holding its GPU memory."""
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)


def start_worker():
    torch.set_num_threads(1)
    threading.Thread(target=exit_with_parent, args=(os.getppid(),), daemon=True).start()


def in_processes(fn, jobs, workers, fresh=False):
    """Run ``fn(*job)`` for every job (submitted in the order given) in `workers` spawned processes of one
    CPU thread each; yields ``(index into jobs, result)`` as each finishes. A job's error is raised here, and
    it, or the caller stopping early, cancels the jobs not yet started. `fresh`: every job in a new process
    (a job that leaves its process unusable, a GPU fault say, cannot fail the jobs after it there), from
    Python 3.11 on (3.10's pool has no such option and reuses its processes)."""
    options = {"max_tasks_per_child": 1} if fresh and sys.version_info >= (3, 11) else {}
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"), initializer=start_worker, **options)
    try:
        futures = {pool.submit(fn, *job): i for i, job in enumerate(jobs)}
        for future in as_completed(futures):
            yield futures[future], future.result()
    finally:
        pool.shutdown(cancel_futures=True)

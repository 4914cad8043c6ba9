import os

import torch

if not torch.cuda.is_available():
    # Triton kernels run under the interpreter on CPU-only machines (CI); it must be set before triton loads.
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one intra-op thread per xdist worker: the workers already fill the cores
    torch.set_num_threads(1)

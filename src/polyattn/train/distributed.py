"""Training on several processes (``torchrun``): the process group, DDP, FSDP2 or context parallelism, each
rank's share of the global batch, sums across ranks, and sharded training states through
``torch.distributed.checkpoint``.

A run with ``parallel="none"`` is one process and uses none of the collectives. Under ``torchrun`` every rank
draws the same global batch from the same seeded generator and keeps its contiguous slice of rows, so N ranks
of ``batch_size / N`` sequences see exactly the batch one process sees. The loss of a rank is the sum over its
scored tokens divided by the global count of scored tokens (known on every rank from the global batch) and
multiplied by N; DDP and FSDP2 average gradients over the N ranks, so the update equals the single-process one.
Context parallelism (``parallel="cp"``) gives every rank all rows of the batch and its contiguous 1/N of every
sequence instead: the mixers exchange their shard summaries (`polyattn.distributed.enable_context_parallel`,
on a process group of their own beside DDP's), so each rank's forward is its part of the whole sequences'
and its backward sends the other ranks their gradients; the same loss scaling and DDP's average then give the
single-process update. Evaluation runs the whole sequences, rows split across the ranks, exchange off.

A training state (model, optimizer, schedule, data generator, history) is a DCP folder: each rank writes its
own shards, and a later run on any number of processes (one included, without a process group) reads them
back resharded to its own layout.
"""

import json
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

PARALLEL = ("none", "ddp", "fsdp", "cp")
TRAIN_STATE_DIR = "train_state"
STEP_DIR = re.compile(r"step-(\d+)")
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Ranks:
    """This process's place in its group; ``Ranks()`` is a single process."""

    rank: int = 0
    world_size: int = 1

    @property
    def main(self):
        """Rank 0: the one that logs, shows progress and writes results."""
        return self.rank == 0

    def rows(self, n):
        """This rank's contiguous share of ``n`` rows (``n`` a multiple of the world size)."""
        size = n // self.world_size
        return slice(self.rank * size, (self.rank + 1) * size)

    def share(self, x, idx, parallel):
        """This rank's part of the global batch ``x[idx]`` (``x: [N, T]``, ``idx: [n]`` rows), gathering only
        that part: its rows (DDP, FSDP), or every row's contiguous 1/N of the positions (CP; ``T`` a multiple
        of the world size)."""
        if parallel == "cp":
            size = x.shape[1] // self.world_size
            return x[:, self.rank * size : (self.rank + 1) * size][idx]
        return x[idx[self.rows(len(idx))]]

    def sum(self, tensor):
        """``tensor`` summed over the ranks (in place on its device; unchanged for a single process)."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor


def check_parallel(config, device):
    """Where a multi-process run cannot start: ValueError naming the option (no process group is created here)."""
    if config.parallel == "none":
        return
    if not dist.is_available():
        raise ValueError(f"parallel: {config.parallel!r} needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        missing = [name for name in TORCHRUN_ENV if name not in os.environ]
        if missing:
            raise ValueError(
                f"parallel: {config.parallel!r} runs under torchrun (e.g. torchrun --nproc-per-node 2 -m polyattn train "
                f"--parallel {config.parallel} ...); the environment lacks {', '.join(missing)}"
            )
    if device.type == "cuda" and device.index is not None:
        raise ValueError(f"device: under parallel={config.parallel!r} each rank uses cuda:LOCAL_RANK; pass cuda or auto, got {config.device!r}")
    if device.type == "cuda" and int(os.environ.get("LOCAL_RANK", 0)) >= torch.cuda.device_count():
        raise ValueError(f"LOCAL_RANK {os.environ['LOCAL_RANK']}: this node has {torch.cuda.device_count()} GPUs (--nproc-per-node at most that)")
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    if config.parallel == "cp":
        from polyattn.layers import MIXERS

        unsupported = sorted({name for name in config.layer_names if not MIXERS[name].supports_context_parallel})
        if unsupported:
            raise ValueError(f"parallel: 'cp' needs a mixer with a chunk summary to exchange in every layer, got {unsupported}")
        lengths = sorted({seg.seq_len for seg in config.train_segments if seg.seq_len % world})
        if lengths:
            raise ValueError(f"train_segments: under parallel='cp' each length is split evenly over the {world} ranks, got lengths {lengths}")
    elif config.batch_size % world:
        raise ValueError(f"batch_size: expected a multiple of the world size {world} (each rank takes an equal share), got {config.batch_size}")


@contextmanager
def process_group(config, device):
    """``(device, ranks)`` of this process: a single process for ``parallel="none"``; else the group of the
    launch (``env://`` from torchrun, nccl on CUDA, gloo on CPU; created here and destroyed on exit unless the
    caller created it, after a barrier when the body ended without an error), the device ``cuda:LOCAL_RANK`` on CUDA."""
    if config.parallel == "none":
        yield device, Ranks()
        return
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    finished = False
    try:
        yield device, Ranks(dist.get_rank(), dist.get_world_size())
        finished = True
    finally:
        if created:
            if finished:  # no rank takes its connections down while another still works (rank 0 writes the files)
                dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
            dist.destroy_process_group()


def parallelize(objective, config, device, ranks):
    """``torch.compile`` on every block (``config.compile`` names the backend), then DDP around the whole
    objective or FSDP2 ``fully_shard`` on every block and on the root (embedding, final norm, tied head). FSDP's
    mixed precision on CUDA with bf16: parameters gathered in bf16, gradients reduced in fp32."""
    if config.compile:
        for block in objective.lm.blocks:
            block.compile(backend=config.compile)
    if config.parallel == "cp":
        from polyattn.distributed import enable_context_parallel

        enable_context_parallel(objective.lm, dist.new_group())  # every rank, a communicator apart from DDP's
    if config.parallel in ("ddp", "cp"):
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(objective, device_ids=[device.index] if device.type == "cuda" else None)
    if config.parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        low = device.type == "cuda" and config.bf16
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if low else None, reduce_dtype=torch.float32 if low else None)
        mesh = init_device_mesh(device.type, (ranks.world_size,))
        for block in objective.lm.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(objective, mesh=mesh, mp_policy=policy)
    return objective


def full_model_state(model):
    """The whole state dict of an FSDP-sharded model, on the CPU of rank 0 (every rank must call it; the
    others get an empty dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def train_state(objective, opt, sched, progress):
    """The DCP state of a run: model and optimizer (sharded as the run shards them), schedule, progress (its
    history as one JSON string: DCP would flatten a list of dicts into keys that a fresh run lacks)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(objective, opt)
    progress = {**progress, "history": json.dumps(progress["history"])}
    return {"model": model_state, "optim": optim_state, "schedule": sched.state_dict(), "progress": progress}


def save_train_state(out_dir, objective, opt, sched, progress, gen):
    """Write ``out_dir/train_state/step-<step>`` (each rank its shards, the data generator's state with them);
    returns the folder."""
    import torch.distributed.checkpoint as dcp

    progress["generator"] = gen.get_state()
    path = Path(out_dir) / TRAIN_STATE_DIR / f"step-{progress['step']}"
    dcp.save(train_state(objective, opt, sched, progress), checkpoint_id=str(path), no_dist=not dist.is_initialized())
    return path


def find_train_state(path):
    """A training-state folder: ``path`` itself when it holds DCP metadata, else its latest ``step-N``
    (``path`` may be a run's output folder or its ``train_state``); ValueError when there is none."""
    path = Path(path)
    for folder in (path, path / TRAIN_STATE_DIR):
        if (folder / ".metadata").is_file():
            return folder
        steps = [(int(m.group(1)), p) for p in folder.glob("step-*") if (m := STEP_DIR.fullmatch(p.name)) and (p / ".metadata").is_file()]
        if steps:
            return max(steps)[1]
    raise ValueError(f"resume: expected a training state (a folder with .metadata, or step-N folders under it or its {TRAIN_STATE_DIR}) at {str(path)!r}, found none")


def load_train_state(path, objective, opt, sched, progress):
    """Read a DCP training state into the (possibly sharded) objective, optimizer and schedule, resharding it
    to this run's layout; returns the saved progress (``progress`` gives its structure)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = train_state(objective, opt, sched, progress)
    try:
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except (RuntimeError, KeyError, ValueError) as err:
        raise ValueError(f"resume: {str(path)!r} does not hold a training state of this model and optimizer ({err})") from err
    set_state_dict(objective, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sched.load_state_dict(state["schedule"])
    return {**state["progress"], "history": json.loads(state["progress"]["history"])}

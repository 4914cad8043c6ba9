"""Distributed polyattn: context parallelism for every family (``context``)."""

from polyattn.distributed.context import ContextParallel, Shard, enable_context_parallel, shard_bounds, shard_layout

__all__ = ["ContextParallel", "Shard", "enable_context_parallel", "shard_bounds", "shard_layout"]

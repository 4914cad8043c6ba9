"""Distributed polyattn: context parallelism for every family (``context``)."""

from polyattn.distributed.context import ContextParallel, Shard, shard_bounds, shard_layout

__all__ = ["ContextParallel", "Shard", "shard_bounds", "shard_layout"]

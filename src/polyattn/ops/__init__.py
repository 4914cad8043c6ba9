"""polyattn operators: every mechanism as a function ``op(q, k, v, ...) -> (o, final_state)``."""

from polyattn.ops.delta import delta_rule
from polyattn.ops.hla import hla
from polyattn.ops.kata import kata
from polyattn.ops.linear import linear_attn
from polyattn.ops.loglinear import loglinear_attn

__all__ = ["delta_rule", "hla", "kata", "linear_attn", "loglinear_attn"]

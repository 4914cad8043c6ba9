"""Long-sequence numerics (ops/hla/README.md, "Numerics"): bf16 inputs, fp32 states, T = 16384; and the growth script."""

import pytest
import torch

from hla_cases import VARIANTS, hla_inputs, variant_kwargs
from polyattn import ops
from polyattn.ops.hla.growth import format_table, growth_table
from polyattn.testing import rel_err

T_LONG = 16384


@pytest.mark.parametrize("decay", [True, False], ids=["g", "nog"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_bf16_long_sequence(name, decay):
    x = hla_inputs(1, T_LONG, 1, 8, 8, decay=decay, normalize=False, seed=50)
    kw = variant_kwargs(name, False, None)
    low = {n: None if t is None else t.to(torch.bfloat16) for n, t in x.items()}
    o, s = ops.hla(**low, **kw, output_final_state=True, impl="chunk")
    o_ref, s_ref = ops.hla(**{n: None if t is None else t.double() for n, t in low.items()}, **kw, output_final_state=True, impl="chunk")
    assert o.dtype == torch.bfloat16 and all(f.dtype == torch.float32 for f in s)
    assert bool(torch.isfinite(o).all()) and all(bool(torch.isfinite(f).all()) for f in s)
    o_err, s_err = rel_err(o, o_ref), max(rel_err(a, b) for a, b in zip(s, s_ref))
    print(f"{name}-{'g' if decay else 'nog'} T={T_LONG}: bf16 output rel err {o_err:.2e}, fp32 state rel err {s_err:.2e}, max|o| {o_ref.abs().max().item():.3g}")
    assert o_err <= 1e-2  # bf16 output rounding is 2^-9 ≈ 2e-3 of each value
    assert s_err <= 1e-5  # the fp32 states and intermediates Y, Z


def test_growth_table_shape_and_order():
    # A small run of the growth script: higher order grows faster than first order.
    table = growth_table(positions=(16, 128), dim=16, batch=2, seed=0)
    for row in table.values():
        ratios = {name: values[1] / values[0] for name, values in row.items()}
        assert ratios["HLA3"] > ratios["HLA2"] > ratios["1st-order LA"]
    assert "HLA3" in format_table(table, (16, 128))

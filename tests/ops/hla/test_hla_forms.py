"""The float64 ladder: recurrent, chunk and scan == naive for every variant × normalize × decay, states included."""

import pytest
import torch

from polyattn.ops.hla import HLA_FORMS
from polyattn.ops.hla.scan import SCAN_RULES
from hla_cases import VARIANTS, hla_inputs, variant_kwargs
from polyattn.testing import assert_close_rel, assert_states_close

TOL = 1e-10
C = 8


def options(name, normalize):
    return dict(variant_kwargs(name, normalize, 0.7), eps=1e-6)


CASES = [
    pytest.param(name, form, T, decay, normalize, id=f"{name}-{form}-B2-T{T}-H2-K5-V4-{'g' if decay else 'nog'}-{'norm' if normalize else 'plain'}")
    for name in VARIANTS
    for form in ("recurrent", "chunk", "scan")
    for T in (1, 3 * C + 5)
    for decay in (True, False)
    for normalize in (False, True)
]


@pytest.mark.parametrize("name, form, T, decay, normalize", CASES)
def test_form_equals_naive(name, form, T, decay, normalize):
    x = hla_inputs(2, T, 2, 5, 4, decay=decay, normalize=normalize, seed=T)
    opts = options(name, normalize)
    extra = {"chunk_size": C} if form != "recurrent" else {}
    o_ref, s_ref = HLA_FORMS["naive"](**x, **opts, output_final_state=True)
    o, s = HLA_FORMS[form](**x, **opts, output_final_state=True, **extra)
    assert_close_rel(o, o_ref, TOL, "o")
    assert_states_close(s, s_ref, TOL, "final_state")
    # and from the (non-trivial) state that a prefix leaves behind
    prefix = hla_inputs(2, 11, 2, 5, 4, decay=decay, normalize=normalize, seed=T + 1)
    _, h0 = HLA_FORMS["naive"](**prefix, **opts, output_final_state=True)
    o_ref, s_ref = HLA_FORMS["naive"](**x, **opts, initial_state=h0, output_final_state=True)
    o, s = HLA_FORMS[form](**x, **opts, initial_state=h0, output_final_state=True, **extra)
    assert_close_rel(o, o_ref, TOL, "o from h0")
    assert_states_close(s, s_ref, TOL, "final_state from h0")


@pytest.mark.parametrize("chunk_size", [1, 4, 16, 64])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_chunk_sizes(name, chunk_size):
    x = hla_inputs(1, 37, 2, 4, 3, decay=True, normalize=False, seed=21)
    opts = options(name, False)
    o_ref, s_ref = HLA_FORMS["naive"](**x, **opts, output_final_state=True)
    for form in ("chunk", "scan"):
        o, s = HLA_FORMS[form](**x, **opts, output_final_state=True, chunk_size=chunk_size)
        assert_close_rel(o, o_ref, TOL, form)
        assert_states_close(s, s_ref, TOL, form)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_scan_combine_is_associative(name):
    # Spec §9 test 6: associativity on random segments with decay (catches errata 2 and 4).
    combine = SCAN_RULES[name].combine
    gen = torch.Generator().manual_seed(22)
    K, V = 3, 2
    n_fields = {"hla2": 3, "ahla": 3, "hla3": 6}[name]
    widths = {"hla2": (K, V, V), "ahla": (V, V, K), "hla3": (K, V, V, K, V, K)}[name]
    assert len(widths) == n_fields

    def segment():
        a = -torch.rand(2, 1, generator=gen, dtype=torch.float64)  # [B, H]
        return (a,) + tuple(torch.randn(2, 1, K, w, generator=gen, dtype=torch.float64) for w in widths)

    A, B, D = segment(), segment(), segment()
    left = combine(combine(A, B), D)
    right = combine(A, combine(B, D))
    for i, (l, r) in enumerate(zip(left, right)):
        assert_close_rel(l, r, TOL, f"field {i}")

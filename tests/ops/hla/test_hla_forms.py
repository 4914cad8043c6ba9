"""The float64 ladder: recurrent, chunk and scan == naive for every variant × normalize × decay, states included."""

import pytest
import torch

from hla_cases import VARIANTS, hla_inputs, variant_kwargs
from polyattn.ops.hla import HLA_FORMS
from polyattn.ops.hla.scan import SCAN_RULES, combine_ahla
from polyattn.testing import assert_close_rel, assert_states_close, rel_err

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


def _paper_combine_hla2_g_form(rule):
    """The paper-form (S, C, G) combine with the paper's ``ρ_B G_A`` (erratum 2) or the corrected ``ρ_B² G_A``."""

    def combine(left, right):
        a1, S1, C1, G1 = left
        a2, S2, C2, G2 = right
        r = torch.exp(a2)[..., None, None]
        return a1 + a2, r * S1 + S2, r * C1 + C2, (r if rule == "paper" else r * r) * G1 + G2 + r * (S2 @ C1)

    return combine


def _paper_combine_ahla(left, right):
    """The AHLA combine with the paper's decayed ``R = ρ_B R_A + R_B`` (erratum 4)."""
    a, P, E, _ = combine_ahla(left, right)
    return a, P, E, torch.exp(right[0])[..., None, None] * left[3] + right[3]


def _associativity_error(combine, widths, seed):
    gen = torch.Generator().manual_seed(seed)

    def segment():
        a = -torch.rand(2, 1, generator=gen, dtype=torch.float64)  # [B, H]
        return (a,) + tuple(torch.randn(2, 1, 3, w, generator=gen, dtype=torch.float64) for w in widths)

    A, B, D = segment(), segment(), segment()
    return max(rel_err(l, r) for l, r in zip(combine(combine(A, B), D), combine(A, combine(B, D))))


def test_errata_2_and_4_paper_decayed_combines_are_not_associative():
    assert _associativity_error(_paper_combine_hla2_g_form("paper"), (3, 2, 2), 23) > 1e-2
    assert _associativity_error(_paper_combine_hla2_g_form("corrected"), (3, 2, 2), 23) <= TOL
    assert _associativity_error(_paper_combine_ahla, (2, 2, 3), 24) > 1e-2


@pytest.mark.parametrize("name", list(VARIANTS))
def test_scan_combine_is_associative(name):
    # ops/hla/README.md, "Associative combine": associativity on random segments with decay (catches errata 2 and 4).
    widths = {"hla2": (3, 2, 2), "ahla": (2, 2, 3), "hla3": (3, 2, 2, 3, 2, 3)}[name]  # K = 3, V' = 2
    assert _associativity_error(SCAN_RULES[name].combine, widths, 22) <= TOL

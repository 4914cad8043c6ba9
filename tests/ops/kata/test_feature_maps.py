"""KATA feature maps: ψ(q)·ψ(k) == κ(q, k), Gram matrices PSD, bilinear read/write == lifted ones, svec packing."""

import pytest
import torch

from polyattn.ops.kata import FEATURE_MAPS, kata, kata_state_size, make_feature_map
from polyattn.testing import assert_close_rel, seeded_inputs

TOL = 1e-12

MAPS = [
    pytest.param("psd", 1, "concat", id="psd-M1"),
    pytest.param("psd", 2, "concat", id="psd-M2"),
    pytest.param("psd", 4, "concat", id="psd-M4"),
    pytest.param("psd", 2, "sum", id="psd-S2"),
    pytest.param("psd", 4, "sum", id="psd-S4"),
    pytest.param("orthant", 1, "concat", id="orthant"),
    pytest.param("lorentz", 1, "concat", id="lorentz"),
]


def _kappa_by_definition(feature, groups, combine, q, k):
    """κ(q, k) for one pair of vectors, straight from the README table (Python sums, no feature map code)."""
    if feature == "orthant":
        return ((torch.relu(q) + 1e-6) * (torch.relu(k) + 1e-6)).sum()
    if feature == "lorentz":
        nq, nk = q[:-1].norm(), k[:-1].norm()
        return q[:-1] @ k[:-1] + nq * nk * (1 + q[-1] ** 2) * (1 + k[-1] ** 2)
    qg, kg = q.reshape(groups, -1), k.reshape(groups, -1)
    if combine == "concat":
        return sum((qg[i] @ kg[i]) ** 2 for i in range(groups))
    return sum((qg[i] @ kg[j]) ** 2 for i in range(groups) for j in range(groups))


@pytest.mark.parametrize("feature, groups, combine", MAPS)
def test_lift_inner_product_is_the_kernel(feature, groups, combine):
    fmap = make_feature_map(feature, 8, groups, combine)
    x = seeded_inputs(2, 5, 1, 8, 3, seed=1)
    q, k = x["q"][:, :, 0], x["k"][:, :, 0]  # [B, T, K]
    kappa = fmap.kernel(q, k)  # [B, T, T]
    assert_close_rel(fmap.lift(q) @ fmap.lift(k).transpose(-1, -2), kappa, TOL, "lift")
    expected = torch.stack([torch.stack([_kappa_by_definition(feature, groups, combine, q[0, t], k[0, s]) for s in range(5)]) for t in range(5)])
    assert_close_rel(kappa[0], expected, TOL, "definition")
    assert fmap.lift(q).shape[-1] == fmap.dim()
    if fmap.grouped:
        packed = fmap.lift(q, packed=True) @ fmap.lift(k, packed=True).transpose(-1, -2)
        assert_close_rel(packed, kappa, TOL, "packed")
        assert fmap.lift(q, packed=True).shape[-1] == fmap.dim(packed=True)


@pytest.mark.parametrize("feature, groups, combine", MAPS)
def test_gram_is_psd_and_nonnegative(feature, groups, combine):
    fmap = make_feature_map(feature, 8, groups, combine)
    X = seeded_inputs(1, 24, 1, 8, 1, seed=2)["q"][0, :, 0]  # [24, K]
    gram = fmap.kernel(X, X)  # [24, 24]
    assert_close_rel(gram, gram.T, TOL, "symmetric")
    eig = torch.linalg.eigvalsh(gram)
    assert eig.min() >= -1e-12 * eig.abs().max(), f"Gram matrix has eigenvalue {eig.min():.3e}"
    assert (gram >= 0).all(), "cone kernels give nonnegative weights"


@pytest.mark.parametrize("feature, groups, combine", MAPS)
def test_bilinear_read_and_write_equal_lifted(feature, groups, combine):
    fmap = make_feature_map(feature, 8, groups, combine)
    x = seeded_inputs(2, 6, 1, 8, 3, seed=3)
    q, k, v = x["q"][:, :, 0], x["k"][:, :, 0], x["v"][:, :, 0]
    S = fmap.write(k, v)  # [B, P, V]
    assert_close_rel(S, fmap.lift(k).transpose(-1, -2) @ v, TOL, "write")
    assert_close_rel(fmap.read(q, S), fmap.lift(q) @ S, TOL, "read")


@pytest.mark.parametrize("groups, combine", [(1, "concat"), (2, "concat"), (4, "sum")], ids=["M1", "M2", "S4"])
def test_kernel_vjp_is_the_kernels_gradient(groups, combine):
    """`kernel_vjp` (the PSD maps' written-out gradient of Σ grad ⊙ κ(q, k)) against autograd through `kernel`."""
    fmap = make_feature_map("psd", 8, groups, combine)
    x = seeded_inputs(2, 5, 1, 8, 3, seed=4)
    q, k = (x[n][:, :, 0].requires_grad_() for n in ("q", "k"))  # [B, T, K]
    grad = torch.randn(2, 5, 5, generator=torch.Generator().manual_seed(5), dtype=q.dtype)
    want = torch.autograd.grad((fmap.kernel(q, k) * grad).sum(), (q, k))
    for name, a, b in zip(("dq", "dk"), fmap.kernel_vjp(q.detach(), k.detach(), grad), want):
        assert_close_rel(a, b, TOL, name)


@pytest.mark.parametrize("groups, combine", [(1, "concat"), (2, "concat"), (2, "sum")], ids=["M1", "M2", "S2"])
def test_packed_state_halves_and_reads_exactly(groups, combine):
    x = seeded_inputs(1, 9, 2, 6, 3, seed=4)
    _, state = kata(**{n: x[n] for n in ("q", "k", "v", "g")}, groups=groups, combine=combine, output_final_state=True)
    fmap = make_feature_map("psd", 6, groups, combine)
    packed = fmap.pack_state(state.S)  # [N, H, P_packed, V]
    assert packed.shape[-2] == fmap.dim(packed=True) < fmap.dim()
    assert_close_rel(fmap.unpack_state(packed), state.S, TOL, "roundtrip")
    q = x["q"] * 6**-0.5
    assert_close_rel(fmap.lift(q.transpose(1, 2), packed=True) @ packed, fmap.read(q.transpose(1, 2), state.S), TOL, "packed read")


def test_state_size_table_of_spec():
    # ops/kata/README.md, "State sizes", d_k = d_v = 64: numerator P·d_v, full / packed
    table = {(1, "concat"): (262_144, 133_120), (2, "concat"): (131_072, 67_584), (4, "concat"): (65_536, 34_816),
             (2, "sum"): (65_536, 33_792), (4, "sum"): (16_384, 8_704)}
    for (groups, combine), (full, packed) in table.items():
        assert kata_state_size(64, 64, groups, combine, False) == full
        assert kata_state_size(64, 64, groups, combine, True) == packed
    assert 2 * kata_state_size(64, 64, 1, "concat", True) == 266_240  # the paper's KATA-M1 MQAR figure
    assert kata_state_size(64, 64, feature="orthant") == 64 * 64


def test_registry_names_and_kernel_docs():
    assert set(FEATURE_MAPS) == {"psd", "orthant", "lorentz"}
    assert "Σ_i (q_i·k_i)²" in make_feature_map("psd", 4, 2, "concat").kernel_doc
    assert "Σ_{i,j} (q_i·k_j)²" in make_feature_map("psd", 4, 2, "sum").kernel_doc


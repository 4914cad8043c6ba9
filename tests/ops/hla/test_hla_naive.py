"""Pin ``hla_naive`` to the index-sum definitions of ops/hla/README.md ("Definitions") and to errata 1 and 6."""

import itertools

import pytest
import torch

from hla_cases import VARIANTS
from polyattn.ops.hla import hla_naive
from polyattn.testing import assert_close_rel, rel_err, seeded_inputs

TOL = 1e-10


def _seg(g, s, t):
    """Log-decay from position s to t >= s: g[s+1] + ... + g[t]."""
    return sum(g[s + 1 : t + 1])


def _dot(a, b):
    return sum(x * y for x, y in zip(a, b))


def _brute_force(name, q, k, v, g):
    """One head as Python lists; returns (num [T][V], den [T]) by the README's literal index sums."""
    T = len(q)
    num = [[0.0] * len(v[0]) for _ in range(T)]
    den = [0.0] * T
    for t in range(T):
        if name == "hla2":  # index set i <= j <= t, weight g^{2t-i-j}
            terms = (
                (_seg(g, i, j) + 2 * _seg(g, j, t), _dot(q[t], k[i]) * _dot(q[j], k[i]), j)
                for j in range(t + 1)
                for i in range(j + 1)
            )
        elif name == "ahla":  # index set j <= i <= t, weight g^{t-i} g^{i-j}
            terms = (
                (_seg(g, j, t), _dot(q[t], k[i]) * _dot(q[i], k[j]), j)
                for j in range(t + 1)
                for i in range(j, t + 1)
            )
        else:  # index set {i <= u, j <= u, u <= t}, weight g^{3t-i-u-j}
            terms = (
                (_seg(g, i, t) + _seg(g, u, t) + _seg(g, j, t), _dot(q[t], k[i]) * _dot(q[u], k[i]) * _dot(q[u], k[j]), j)
                for u in range(t + 1)
                for i in range(u + 1)
                for j in range(u + 1)
            )
        for log_w, score, j in terms:
            w = torch.tensor(log_w, dtype=torch.float64).exp().item() * score
            num[t] = [a + w * b for a, b in zip(num[t], v[j])]
            den[t] += w
    return torch.tensor(num, dtype=torch.float64), torch.tensor(den, dtype=torch.float64)


@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
@pytest.mark.parametrize("decay", [False, True], ids=["nog", "g"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_naive_equals_index_sums(name, decay, normalize):
    x = seeded_inputs(2, 7, 2, 3, 2, decay=decay, seed=10)
    if normalize:  # the normalized form needs nonnegative features
        x["q"], x["k"] = x["q"].abs(), x["k"].abs()
    scale = 0.8
    order, asymmetric = VARIANTS[name]
    o, _ = hla_naive(x["q"], x["k"], x["v"], x["g"], order=order, asymmetric=asymmetric, normalize=normalize, eps=1e-6, scale=scale)
    for b, h in itertools.product(range(2), range(2)):
        q = (scale * x["q"][b, :, h]).tolist()
        g = [0.0] * 7 if x["g"] is None else x["g"][b, :, h].tolist()
        num, den = _brute_force(name, q, x["k"][b, :, h].tolist(), x["v"][b, :, h].tolist(), g)
        expected = num / (den[:, None] + 1e-6) if normalize else num
        assert_close_rel(o[b, :, h], expected, TOL, f"{name} b={b} h={h}")


def test_naive_hla2_undecayed_is_the_masked_matrix_form():
    # matrix form O = ((W Wᵀ) ⊙ L) V with W = L ⊙ QKᵀ.
    x = seeded_inputs(1, 9, 1, 4, 3, decay=False, seed=11)
    q, k, v = (t[0, :, 0] for t in (x["q"], x["k"], x["v"]))
    L = torch.tril(torch.ones(9, 9, dtype=torch.float64))
    W = L * (q @ k.T)  # [T, T]
    o, _ = hla_naive(x["q"], x["k"], x["v"], scale=1.0)
    assert_close_rel(o[0, :, 0], ((W @ W.T) * L) @ v, TOL)


def _paper_g_form(q, k, v, g, corrected):
    """Paper Alg. 1 state (S, C, G), printed decayed update or the corrected one (README "Streaming recurrences")."""
    S = torch.zeros(q.shape[1], q.shape[1], dtype=torch.float64)
    C = torch.zeros(q.shape[1], v.shape[1], dtype=torch.float64)
    G = torch.zeros_like(C)
    out = []
    for t in range(q.shape[0]):
        a = torch.exp(g[t])
        kk = torch.outer(k[t], k[t])  # [K, K]
        G = (a * a * G + a * kk @ C) if corrected else (a * G + kk @ C)  # uses the OLD C
        S = a * S + kk
        C = a * C + torch.outer(q[t], v[t])
        out.append(q[t] @ (S @ C) - q[t] @ G)
    return torch.stack(out)


def test_erratum_1_decayed_g_update():
    x = seeded_inputs(1, 12, 1, 4, 3, seed=12)
    q, k, v, g = x["q"][0, :, 0], x["k"][0, :, 0], x["v"][0, :, 0], x["g"][0, :, 0]
    o, _ = hla_naive(x["q"], x["k"], x["v"], x["g"], scale=1.0)
    assert_close_rel(_paper_g_form(q, k, v, g, corrected=True), o[0, :, 0], TOL)
    assert rel_err(_paper_g_form(q, k, v, g, corrected=False), o[0, :, 0]) > 1e-2


def test_erratum_6_paper_third_order_is_a_different_operator():
    # The paper's Thm 7.1 operator is not masked W Wᵀ W. Its closed form (ops/hla/README.md, "The paper's
    # third-order operator") holds with an inclusive outer call:
    # LA(Q,Y,Z) - LA(Q,Yx,Zx) + LA(Q,K,s⊙V), Yx = LAx(Q,K,K), Zx = LAx(Q,K,V).
    x = seeded_inputs(1, 10, 1, 3, 2, decay=False, seed=13)
    q, k, v = (t[0, :, 0] for t in (x["q"], x["k"], x["v"]))
    L, Lx = torch.tril(torch.ones(10, 10, dtype=torch.float64)), torch.tril(torch.ones(10, 10, dtype=torch.float64), -1)
    A = q @ k.T  # [T, T]
    Y, Z, Yx, Zx = (L * A) @ k, (L * A) @ v, (Lx * A) @ k, (Lx * A) @ v
    s = (torch.triu(A, 1) ** 2).sum(dim=0)  # s_t = Σ_{u<t} (q_u·k_t)²
    paper = (L * (q @ Y.T)) @ Z - (L * (q @ Yx.T)) @ Zx + (L * A) @ (s[:, None] * v)
    o, _ = hla_naive(x["q"], x["k"], x["v"], order=3, scale=1.0)
    assert rel_err(paper, o[0, :, 0]) > 1e-2
    brute = torch.zeros_like(v)  # the paper's set: triples (i, u, j) <= t whose maximum is attained at least twice
    for t, i, u, j in itertools.product(range(10), repeat=4):
        m = max(i, u, j)
        if m <= t and [i, u, j].count(m) >= 2:
            brute[t] += A[t, i] * A[u, i] * A[u, j] * v[j]
    assert_close_rel(paper, brute, TOL)

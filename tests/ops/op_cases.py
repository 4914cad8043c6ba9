"""Every op configuration and its PyTorch forms, called one way: ``call(x, impl, **kwargs) -> (o, state)``.

``x`` holds ``q, k, v, g, beta, lam`` (``[B, T, H, ...]``); each case picks what its op needs (unit keys
for the delta rules, nonnegative q and k for normalized HLA). ``restart(x, r)`` gives the call that
continues a sequence cut at ``r`` from an empty state (log-linear levels follow absolute positions).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

import torch

from polyattn import ops
from polyattn.ops.common import num_levels
from polyattn.ops.loglinear import LogLinearState


def case_inputs(T=150, B=1, H=2, K=8, V=6, *, dtype=torch.float64, seed=0) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = dict(q=randn(B, T, H, K), k=randn(B, T, H, K), v=randn(B, T, H, V))
    x["g"] = -0.1 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    x["beta"] = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    x["lam"] = torch.rand(B, T, H, num_levels(T), generator=gen, dtype=torch.float64)
    return {n: t.to(dtype) for n, t in x.items()}


@dataclass(frozen=True)
class OpCase:
    name: str
    impls: tuple[str, ...]
    run: Callable  # run(q, k, v, g, beta, lam, **kwargs)
    unit_keys: bool = False
    positive: bool = False
    positional: bool = False  # log-linear: an empty state at position r continues a cut at r

    def inputs(self, x: dict) -> dict:
        """``x`` with this case's q and k (nonnegative, unit keys), the keywords of ``run``."""
        q, k = x["q"], x["k"]
        if self.positive:
            q, k = q.abs(), k.abs()
        if self.unit_keys:
            k = torch.nn.functional.normalize(k, dim=-1)
        return {**x, "q": q, "k": k}

    def call(self, x: dict, impl: str, **kwargs):
        return self.run(**self.inputs(x), impl=impl, **kwargs)

    def restart(self, x: dict, r: int, impl: str, **kwargs):
        """The same op on tokens ``r:`` from an empty state (what an exact reset at r leaves)."""
        tail = {n: t[:, r:] for n, t in x.items()}
        if self.positional:
            B, _, H, K = x["q"].shape
            levels = torch.zeros(B, H, x["lam"].shape[-1], K, x["v"].shape[-1], dtype=x["q"].dtype)
            kwargs["initial_state"] = LogLinearState(levels, torch.full((B,), r, dtype=torch.int64))
        return self.call(tail, impl, **kwargs)


def _hla(order, asymmetric, normalize):
    return lambda q, k, v, g, beta, lam, **kw: ops.hla(q, k, v, g, order=order, asymmetric=asymmetric, normalize=normalize, **kw)


def _kata(**options):
    return lambda q, k, v, g, beta, lam, **kw: ops.kata(q, k, v, g, **options, **kw)


CASES = [
    OpCase("linear", ("naive", "recurrent", "chunk", "scan"), lambda q, k, v, g, beta, lam, **kw: ops.linear_attn(q, k, v, g, **kw)),
    OpCase("delta", ("naive", "recurrent", "chunk"), lambda q, k, v, g, beta, lam, **kw: ops.delta_rule(q, k, v, beta, g, **kw), unit_keys=True),
    *(
        OpCase(f"{name}{'-norm' if normalize else ''}", ("naive", "recurrent", "chunk", "scan"), _hla(order, asym, normalize), positive=normalize)
        for order, asym, name in ((2, False, "hla2"), (2, True, "ahla"), (3, False, "hla3"))
        for normalize in (False, True)
    ),
    OpCase(
        "loglinear-mamba2", ("naive", "recurrent", "chunk"),
        lambda q, k, v, g, beta, lam, **kw: ops.loglinear_attn(q, k, v, lam, g, **kw), positional=True,
    ),
    OpCase(
        "loglinear-gdn", ("naive", "recurrent", "chunk"),
        lambda q, k, v, g, beta, lam, **kw: ops.loglinear_attn(q, k, v, lam, g, beta=beta, **kw), unit_keys=True, positional=True,
    ),
    OpCase("kata-m2", ("naive", "recurrent", "chunk", "scan", "parallel"), _kata(groups=2)),
    OpCase("kata-s2", ("naive", "recurrent", "chunk", "scan", "parallel"), _kata(groups=2, combine="sum")),
    OpCase("kata-orthant", ("naive", "recurrent", "chunk", "scan", "parallel"), _kata(feature="orthant")),
    OpCase("kata-lorentz", ("naive", "recurrent", "chunk", "scan", "parallel"), _kata(feature="lorentz", normalize=False)),
    OpCase("deltakata-m2", ("naive", "recurrent", "chunk"), lambda q, k, v, g, beta, lam, **kw: ops.kata(q, k, v, g, groups=2, beta=beta, normalize=False, **kw)),
]

BY_NAME = {case.name: case for case in CASES}
FORM_PARAMS = [(case.name, impl) for case in CASES for impl in case.impls]
FORM_IDS = [f"{name}-{impl}" for name, impl in FORM_PARAMS]

"""``hla2``, ``ahla``, ``hla3``: higher-order linear attention (Zhang, Qin, Gu) in the common shell.

q/k/v projections, short conv + SiLU, q/k post-processing (L2 norm by default: unnormalized HLA outputs
grow polynomially in t, ops/hla/README.md, "Output growth"), an optional feature map, an optional learned per-token
decay ``g = −exp(A_log)·softplus(a_proj x + dt_bias)`` (on by default), the HLA composition, then a
per-head output RMSNorm and ``o_proj``. ``normalize=True`` requires a positive feature map (``elu1`` or
``relu``): with signed features the denominator changes sign (ops/hla/README.md, "Normalized variant"); the config check
enforces it.

Where the decay acts (HLA has no published experiments, so this shell is ours). HLA is a composition
of linear-attention calls (`polyattn.ops.hla.variants`): inner calls build moments (HLA2's
``Y = LA(Q, K, K)``, AHLA's and HLA3's ``Z = LA(Q, K, V)``), the last call reads them over the whole
prefix. By default (``outer_decay=False``) the inner calls decay with ``g`` and the last call does
not (ops/hla/README.md, "Two-rate decay", with an undecayed last call). Without any decay the key moment
``S_j = Σ_{i≤j} k_i k_iᵀ`` piles up every earlier key, a background that grows with j and swamps the
one matching key; the canonical decay (``outer_decay=True``, `ops.hla`: last call at ``2g`` for HLA2,
``g`` for AHLA, ``3g`` for HLA3) removes the background only by forgetting the recalled pair as fast or
faster. With ``outer_decay=True`` the gate's ``A`` is drawn from ``U(0, 16/m)``, m the last call's rate
multiplier (2 or 3; 1 for AHLA), so that its fastest decay starts in a first-order gate's range.
Measured on ``polyattn demo``'s MQAR (450 steps, length-64 accuracy, single runs, lr 1e-2 unless noted):
HLA2 canonical 0.06, no decay 0.07 (q/k norm off), inner decay only 0.63 (0.90 with ``A ~ U(0, 8)``);
AHLA canonical 0.24 (0.80 at lr 3e-2), inner decay only 0.93; HLA3 does not learn in that budget
(it does in 1,500 steps: below) whichever placement: canonical 0.24 (0.23 at lr 3e-2; with
``A ~ U(0, 16/3)`` 0.24, and 0.34 or 0.54 in two runs at lr 3e-2), no decay 0.27 (0.65 at lr 3e-2), inner decay only 0.12 (0.34), the normalized form
(inner decay) 0.12 with elu+1 and 0.14 with relu features (length 64, 8 pairs). With 1,500 steps this shell
(inner decay, lr 1e-2) learns: HLA3 0.997 in two seeds (0.986 / 0.971 with 16 pairs), HLA2 0.999; HLA3's loss
stays near chance for 300-500 steps, then falls (benchmarks/results/demo-cpu-hla-1500/). Before finding this, HLA2 stayed at
chance with lr 3e-2, q/k RMSNorm, relu or elu+1 features, the normalized form, 8 heads, ``scale=1``,
q = k at init, and 1500 steps. The decode state is the calls' states either way.

States per head (ops/hla/README.md, "State"; ``dv' = dv + 1`` when normalized, the ones column):
HLA2 ``S (dk×dk) + F (dk×dv')``; AHLA ``P, E (dk×dv')``; HLA3 ``S (dk×dk) + P, F (dk×dv')``.
"""

from dataclasses import dataclass

from polyattn.layers.common import (
    FEATURE_MAPS,
    POSITIVE_FEATURE_MAPS,
    DecayGate,
    MixerConfig,
    QKNorm,
    QKVMixer,
    check_option,
)
from polyattn.ops.common import resolve_impl
from polyattn.ops.hla.variants import finish_output, prepare, prepare_for_kernels
from polyattn.ops.linear import LINEAR_ATTN_FORMS


@dataclass
class HLAConfig(MixerConfig):
    """``outer_decay=False``: ``g`` decays the inner calls only (module docstring); True: `ops.hla`'s decay."""

    order: int = 2
    asymmetric: bool = False
    normalize: bool = False
    decay: bool = True
    feature_map: str = "identity"
    qk_norm: str = "l2"
    eps: float = 1e-6
    outer_decay: bool = False


class HigherOrderLinearAttention(QKVMixer):
    registry_name = "hla2"
    config_class = HLAConfig

    def __init__(self, d_model, **config):
        super().__init__(d_model, **config)
        cfg = self.config
        check_option("order", cfg.order, (2, 3))
        check_option("feature_map", cfg.feature_map, FEATURE_MAPS)
        if cfg.asymmetric and cfg.order != 2:
            raise ValueError(f"asymmetric HLA (AHLA) is second order only, got order={cfg.order}")
        if cfg.normalize and cfg.feature_map not in POSITIVE_FEATURE_MAPS:
            raise ValueError(
                f"normalize=True needs a positive feature map, one of {list(POSITIVE_FEATURE_MAPS)}, "
                f"got feature_map={cfg.feature_map!r}"
            )
        self.qk_norm = QKNorm(cfg.qk_norm, self.dk)
        rate = cfg.order if cfg.outer_decay and not cfg.asymmetric else 1  # the fastest composed decay is rate·g
        self.decay = DecayGate(d_model, self.heads, a_max=16.0 / rate) if cfg.decay else None

    def mix(self, q, k, v, x, core, use_cache, cu_seqlens=None, position=0):
        cfg = self.config
        phi = FEATURE_MAPS[cfg.feature_map]
        q, k = phi(self.qk_norm(q)), phi(self.qk_norm(k))
        g = None if self.decay is None else self.decay(x)
        options = dict(order=cfg.order, asymmetric=cfg.asymmetric, normalize=cfg.normalize)
        if g is not None and not cfg.outer_decay:
            return self.inner_decay_hla(q, k, v, g, core, use_cache, cu_seqlens=cu_seqlens, **options)
        return self.ops.hla(
            q, k, v, g, **options, eps=cfg.eps, initial_state=core, output_final_state=use_cache,
            cu_seqlens=cu_seqlens, impl=self.impl_for(q.shape[1]),
        )

    def inner_decay_hla(self, q, k, v, g, core, use_cache, cu_seqlens=None, **options):
        """The variant's composed `linear_attn` calls (`polyattn.ops.hla.variants`), all but the last with
        log-decay ``g`` and the last undecayed; same state (the calls' states, in order) as ``ops.hla``.
        Where the calls run the Triton kernels they take the inputs' dtype, like ``ops.hla``'s Triton form
        (bf16 intermediates, ops/hla/README.md "Precision"; in fp32 they took 18x the linear mixer's
        training step on the H200); the PyTorch forms compute in fp32."""
        impl, dtype, scale = self.impl_for(q.shape[1]), q.dtype, q.shape[-1] ** -0.5
        if resolve_impl("linear_attn", impl, LINEAR_ATTN_FORMS, q) is LINEAR_ATTN_FORMS["triton"]:
            variant, v, g, state = prepare_for_kernels(v, g, initial_state=core, **options)
        else:
            variant, q, k, v, g, state, _ = prepare(q, k, v, g, scale=scale, initial_state=core, **options)
            scale = 1.0  # q is scaled
        env, finals = {"k": k, "v": v}, []
        with self.ordered_exchanges():  # context parallel: one exchange per call, in one order on every rank
            for call, initial in zip(variant.calls, state):  # no state given: None (not prepare's zeros) for cu_seqlens
                env[call.out], final = self.ops.linear_attn(
                    q, env[call.key], env[call.value], None if call.out == "o" else g, scale=scale,
                    initial_state=None if core is None else initial, output_final_state=use_cache, cu_seqlens=cu_seqlens,
                    impl=impl,
                )  # [B, T, H, width of the call's values]
                finals.append(final)
        o = finish_output(env["o"], options["normalize"], self.config.eps, dtype)
        return o, (variant.state(*finals) if use_cache else None)

    def core_state_size(self, T):
        cfg = self.config
        dk, dv = self.dk, self.dv + int(cfg.normalize)
        if cfg.asymmetric:
            per_head = 2 * dk * dv
        else:
            per_head = dk * dk + (cfg.order - 1) * dk * dv
        return self.heads * per_head


class AsymmetricHLA(HigherOrderLinearAttention):
    registry_name = "ahla"
    defaults = {"asymmetric": True}


class ThirdOrderHLA(HigherOrderLinearAttention):
    registry_name = "hla3"
    defaults = {"order": 3}

"""The Pallas TPU (Mosaic) backend: slots and bounds prepared here, then the kernels of
`pallas_kernels.tpu` (imported lazily: an optional accelerator).

`attention_pallas_tpu` / `cca_attention_pallas_tpu` take the kernels' tiling overrides and
`interpret` (default: the TPU interpreter on CPU) for tests; the backend object `PALLAS_TPU`
is what `run_attention`, the prefill and the decode step call.
"""

from __future__ import annotations

from cca_jax import blocks
from cca_jax.attention.backend import Backend
from cca_jax.attention.pooling import slots_and_bounds
from cca_jax.blocks import CCA, AttentionPattern

# Head dims the decode step runs the decode kernel for; on a TPU also a multiple of the
# 128 lanes (padding would copy the cache every step).
DECODE_HEAD_DIMS = (64, 128, 256)
_LANES = 128


def attention_pallas_tpu(q, k, v, pattern: AttentionPattern, *, pooling: str = "cca",
                         segment_ids=None, interpret=None, **tiling):
    """Attention under `pattern` (full, sliding, streaming, cca) through the TPU kernels;
    the result of `run_attention`. `tiling`: `pallas_kernels.tpu.kernel_config` overrides."""
    from pallas_kernels.tpu import blocked_attention_pallas_tpu
    ck, cv, *bounds = slots_and_bounds(q, k, v, pattern, pooling=pooling,
                                       segment_ids=segment_ids)
    window = blocks.widest_window(pattern, q.shape[1])
    return blocked_attention_pallas_tpu(q, k, v, ck, cv, *bounds, window=window,
                                        interpret=interpret, **tiling)


def cca_attention_pallas_tpu(q, k, v, *, group_size: int, window_size: int,
                             sink_tokens: int = 0, pooling: str = "cca", segment_ids=None,
                             interpret=None, **tiling):
    """CCA attention (SPEC.md; `sink_tokens`: section 6) through the TPU kernels; the
    result of `cca_attention`."""
    return attention_pallas_tpu(q, k, v, CCA(group_size, window_size, sink_tokens),
                                pooling=pooling, segment_ids=segment_ids,
                                interpret=interpret, **tiling)


class PallasTpuBackend(Backend):
    """Every option, packed or not, any float dtype and head dim (padded to 128 lanes);
    decode: `DECODE_HEAD_DIMS`, multiples of 128 on a TPU."""

    def _refuses(self, option, platform, dtype, head_dim, packed, entry):
        if entry != "decode":
            return None
        if head_dim not in DECODE_HEAD_DIMS:
            return f"its decode kernel is used for head_dim in {DECODE_HEAD_DIMS}, not {head_dim}"
        if platform == "tpu" and head_dim % _LANES:
            return f"its decode kernel needs head_dim a multiple of {_LANES} on a TPU"
        return None

    def _attention(self, q, k, v, pattern, *, pooling, segment_ids):
        return attention_pallas_tpu(q, k, v, pattern, pooling=pooling, segment_ids=segment_ids)

    def _blocked(self, q, k, v, ck, cv, raw_lo, core_lo, core_hi, blocking, window):
        from pallas_kernels.tpu import blocked_attention_pallas_tpu
        window = None if window is None else min(window, q.shape[1])
        return blocked_attention_pallas_tpu(q, k, v, ck, cv, raw_lo, core_lo, core_hi,
                                            window=window)

    def _decode(self, q, k_all, v_all, ck, cv, layer, pattern, positions):
        from pallas_kernels.tpu import decode_attention_pallas_tpu
        bounds = blocks.decode_bounds(pattern, positions, k_all.shape[2], ck.shape[2])
        return decode_attention_pallas_tpu(q, k_all, v_all, ck, cv, bounds, layer=layer)


PALLAS_TPU = PallasTpuBackend("pallas_tpu", ("tpu",), "TPUs (or in the TPU interpreter on CPU)",
                              frozenset({"attention", "blocked", "decode"}),
                              interprets_on_cpu=True)

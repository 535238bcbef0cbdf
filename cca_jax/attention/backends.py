"""THE registry of attention backends and the one resolver of `implementation` strings.

  naive       dense L x L masks (tests, small L), every option; never picked by `auto`
  xla         blocked, memory-linear, every platform and option; attention, blocked, decode
  cudnn       `jax.nn.dot_product_attention` through cuDNN: full and sliding, unpacked rows
  mosaic_gpu  Pallas kernels through Mosaic GPU (Hopper; jax's GPU interpreter on CPU)
  pallas_gpu  Pallas kernels through the Triton lowering (interpret mode on CPU)
  pallas_tpu  Pallas kernels through Mosaic (the TPU interpreter on CPU)

`resolve` turns a request into a backend: an explicit name is checked (`Backend.require`:
the reason and the fix when it cannot run); "auto" takes the first of `AUTO_ORDER` that runs
compiled on the platform, supports the call (xla always does) and does not defer it
(`Backend.defers_in_auto`), and logs its pick once.
`blocked_backend` and `decode_backend` are the same resolver for a model's prefill chunks
and decode steps, where the model's own implementation may lack that entry.
"""

from __future__ import annotations

import functools
import logging
import types

import jax

from cca_jax.attention.backend import Backend, platform_name
from cca_jax.attention.cudnn import CUDNN
from cca_jax.attention.naive import NAIVE
from cca_jax.attention.pallas_gpu import PALLAS_GPU
from cca_jax.attention.pallas_mosaic_gpu import MOSAIC_GPU
from cca_jax.attention.pallas_tpu import PALLAS_TPU
from cca_jax.attention.xla import XLA
from cca_jax.blocks import CCA, AttentionPattern

BACKENDS: types.MappingProxyType[str, Backend] = types.MappingProxyType(
    {b.name: b for b in (NAIVE, XLA, MOSAIC_GPU, PALLAS_GPU, CUDNN, PALLAS_TPU)})
IMPLEMENTATION_CHOICES = ("auto", *BACKENDS)
# `auto`'s preference: the fastest first (cuDNN beats the Pallas kernels where it applies;
# Mosaic GPU's forward beats the Triton one on Hopper, 1.47x at 128K).
AUTO_ORDER = ("cudnn", "mosaic_gpu", "pallas_gpu", "pallas_tpu", "xla")

_log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _log_choice_once(kind: str, platform: str, packed: bool, entry: str, name: str) -> None:
    """Log what 'auto' picked, once per (option, platform, packing, entry, choice)."""
    _log.info("attention=%s on %s%s%s: implementation 'auto' -> %r", kind, platform,
              " (packed rows)" if packed else "",
              "" if entry == "attention" else f" ({entry})", name)


def resolve(implementation: str, option: AttentionPattern | None = None, *,
            platform: str | None = None, dtype="bfloat16", head_dim: int = 128,
            packed: bool = False, entry: str = "attention") -> Backend:
    """The backend that runs `entry` of this call.

    implementation: "auto" or a `BACKENDS` name; option: the attention option (default: the
    paper's CCA); platform: a jax backend name (default: `jax.default_backend()`).
    """
    if implementation not in IMPLEMENTATION_CHOICES:
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATION_CHOICES}, got {implementation!r}.")
    option = CCA(16, 1024) if option is None else option
    platform = platform_name(platform or jax.default_backend())
    if implementation != "auto":
        backend = BACKENDS[implementation]
        backend.require(option, platform, dtype, head_dim, packed, entry)
        return backend
    for name in AUTO_ORDER:
        backend = BACKENDS[name]
        if (backend.runs_on(platform, compiled=True)
                and backend.supports(option, platform, dtype, head_dim, packed, entry) is None
                and backend.defers_in_auto(option, platform, dtype, head_dim, packed,
                                           entry) is None):
            _log_choice_once(option.kind, platform, packed, entry, name)
            return backend
    raise AssertionError("xla supports every call")   # unreachable: XLA takes everything


def blocked_backend(implementation: str, option: AttentionPattern, *, head_dim: int,
                    dtype, platform: str | None = None) -> Backend:
    """The per-row-bounds form for a model whose implementation is `implementation`: that
    backend where it has a blocked entry (checked), else what `auto` picks for it."""
    if implementation != "auto" and "blocked" not in BACKENDS[implementation].entries:
        implementation = "auto"
    return resolve(implementation, option, platform=platform, dtype=dtype, head_dim=head_dim,
                   packed=True, entry="blocked")


def decode_backend(implementation: str, option: AttentionPattern, *, head_dim: int, dtype,
                   platform: str | None = None) -> Backend:
    """Decode attention for a model whose implementation is `implementation`: the backend of
    its prefill chunks (`blocked_backend`) where its decode entry takes the call, else XLA
    (logged once)."""
    backend = blocked_backend(implementation, option, head_dim=head_dim, dtype=dtype,
                              platform=platform)
    platform = platform_name(platform or jax.default_backend())
    if backend.supports(option, platform, dtype, head_dim, False, "decode") is None:
        return backend
    _log_choice_once(option.kind, platform, False, "decode", XLA.name)
    return XLA

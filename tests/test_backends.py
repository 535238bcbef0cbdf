"""The backend registry's `supports` reasons and the resolvers of the prefill and decode
entries, on named platforms (no device needed: resolution only)."""

from __future__ import annotations

import pytest

from cca_jax.attention.backends import BACKENDS, blocked_backend, decode_backend, resolve
from cca_jax.blocks import CCA, Full, Streaming

PAPER = CCA(16, 1024)


def test_supports_gives_the_reason():
    cudnn, xla = BACKENDS["cudnn"], BACKENDS["xla"]
    assert "does not compute attention='cca'" in cudnn.supports(PAPER, "gpu", "bfloat16", 128,
                                                                False)
    assert "packed rows" in cudnn.supports(Full(), "gpu", "bfloat16", 128, True)
    assert "float32" in cudnn.supports(Full(), "gpu", "float32", 128, False)
    assert "NVIDIA GPU" in cudnn.supports(Full(), "tpu", "bfloat16", 128, False)
    assert cudnn.supports(Full(), "cuda", "bfloat16", 128, False) is None
    assert "no blocked entry" in cudnn.supports(Full(), "gpu", "bfloat16", 128, False, "blocked")
    for entry in ("attention", "blocked", "decode"):
        assert xla.supports(Streaming(8), "tpu", "float32", 96, True, entry) is None
    assert BACKENDS["pallas_gpu"].supports(PAPER, "cpu", "float32", 64, True) is None  # interpret
    assert BACKENDS["pallas_gpu"].supports(PAPER, "gpu", "bfloat16", 96, False) is None  # padded
    assert BACKENDS["pallas_gpu"].supports(PAPER, "gpu", "bfloat16", 160, False) is None
    assert "head_dim" in BACKENDS["pallas_gpu"].supports(PAPER, "gpu", "bfloat16", 320, False)


def test_explicit_requests_that_cannot_run_name_the_fix():
    with pytest.raises(ValueError, match="no decode entry.*implementation='xla'"):
        BACKENDS["naive"].require(PAPER, "cpu", "float32", 64, False, "decode")
    with pytest.raises(ValueError, match="not on the 'cpu' backend.*implementation='auto'"):
        resolve("cudnn", Full(), platform="cpu")
    with pytest.raises(ValueError, match="implementation must be one of"):
        resolve("triton", PAPER)


def test_auto_never_interprets():
    """On CPU the kernels run only through interpreters: `auto` takes xla there."""
    for entry in ("attention", "blocked", "decode"):
        assert resolve("auto", PAPER, platform="cpu", entry=entry).name == "xla"


def test_prefill_and_decode_entries():
    def blocked(impl, option, d=128, platform="gpu"):
        return blocked_backend(impl, option, head_dim=d, dtype="bfloat16", platform=platform).name

    def decode(impl, option, d=128, platform="gpu"):
        return decode_backend(impl, option, head_dim=d, dtype="bfloat16", platform=platform).name

    assert blocked("auto", Full()) == "pallas_gpu"          # cuDNN has no per-row bounds
    assert blocked("cudnn", Full()) == "pallas_gpu"
    assert blocked("naive", PAPER, platform="cpu") == "xla"
    assert blocked("auto", PAPER, d=96) == "pallas_gpu"        # zero-padded to 128
    assert blocked("auto", PAPER, d=160) == "pallas_gpu"     # zero-padded to 256
    assert blocked("auto", PAPER, d=320) == "xla"
    assert blocked("auto", PAPER, platform="tpu") == "pallas_tpu"
    assert decode("auto", PAPER) == "pallas_gpu"
    assert decode("auto", PAPER, d=96) == "pallas_gpu"        # read in place, masked
    assert decode("auto", PAPER, d=320) == "xla"
    assert decode("auto", PAPER, d=64, platform="tpu") == "xla"   # 128 lanes on a TPU
    assert decode("auto", PAPER, d=128, platform="tpu") == "pallas_tpu"
    assert decode("pallas_tpu", PAPER, d=64, platform="cpu") == "pallas_tpu"   # interpreter


def test_auto_takes_mosaic_gpu_on_hopper_only(monkeypatch):
    """bf16/fp16 on sm_90+: the Mosaic GPU forward; float32, sm_80 or no GPU: the Triton
    kernels; the decode step: the same backend (its own decode kernel or, where that refuses,
    the Triton one's: tests/test_mosaic_gpu_decode.py)."""
    from cca_jax.attention import pallas_mosaic_gpu
    mosaic = BACKENDS["mosaic_gpu"]
    monkeypatch.setattr(pallas_mosaic_gpu, "gpu_capability", lambda: 9.0)
    assert resolve("auto", PAPER, platform="gpu").name == "mosaic_gpu"
    assert resolve("auto", Streaming(8), platform="gpu", packed=True).name == "mosaic_gpu"
    assert resolve("auto", PAPER, platform="gpu", dtype="float32").name == "pallas_gpu"
    assert "float32" in mosaic.supports(PAPER, "gpu", "float32", 128, False)
    assert resolve("auto", PAPER, platform="gpu", head_dim=96).name == "mosaic_gpu"   # padded
    assert "head_dim" in mosaic.supports(PAPER, "gpu", "bfloat16", 320, False)
    assert resolve("auto", Full(), platform="gpu").name == "cudnn"
    assert blocked_backend("auto", Full(), head_dim=128, dtype="bfloat16",
                           platform="gpu").name == "mosaic_gpu"
    assert decode_backend("auto", PAPER, head_dim=128, dtype="bfloat16",
                          platform="gpu").name == "mosaic_gpu"
    assert decode_backend("auto", PAPER, head_dim=96, dtype="bfloat16",
                          platform="gpu").name == "mosaic_gpu"
    monkeypatch.setattr(pallas_mosaic_gpu, "gpu_capability", lambda: 8.0)
    assert "sm_8" in mosaic.supports(PAPER, "gpu", "bfloat16", 128, False)
    assert resolve("auto", PAPER, platform="gpu").name == "pallas_gpu"
    with pytest.raises(ValueError, match="Hopper.*implementation='auto'"):
        resolve("mosaic_gpu", PAPER, platform="gpu")
    monkeypatch.setattr(pallas_mosaic_gpu, "gpu_capability", lambda: None)
    assert "no GPU" in mosaic.supports(PAPER, "gpu", "bfloat16", 128, False)


def test_auto_keeps_wide_heads_on_the_triton_kernels_while_jax_has_them(monkeypatch):
    """The Mosaic GPU kernels take D up to 256, but `auto` sends D above 128 to the Triton
    kernels (measured on the H200) while JAX has them, and to Mosaic GPU once it has not;
    asked for by name, Mosaic GPU runs it."""
    from cca_jax.attention import pallas_gpu, pallas_mosaic_gpu
    monkeypatch.setattr(pallas_mosaic_gpu, "gpu_capability", lambda: 9.0)
    mosaic = BACKENDS["mosaic_gpu"]
    for d in (160, 256):
        assert mosaic.supports(PAPER, "gpu", "bfloat16", d, False) is None
        assert "not yet measured" in mosaic.defers_in_auto(PAPER, "gpu", "bfloat16", d, False)
        assert resolve("auto", PAPER, platform="gpu", head_dim=d).name == "pallas_gpu"
        assert resolve("mosaic_gpu", PAPER, platform="gpu", head_dim=d).name == "mosaic_gpu"
    assert resolve("auto", PAPER, platform="gpu", head_dim=128).name == "mosaic_gpu"
    assert "head_dim up to 256" in mosaic.supports(PAPER, "gpu", "bfloat16", 320, False)
    monkeypatch.setattr(pallas_gpu, "triton_lowering_available", lambda: False)
    assert mosaic.defers_in_auto(PAPER, "gpu", "bfloat16", 256, False) is None
    assert resolve("auto", PAPER, platform="gpu", head_dim=256).name == "mosaic_gpu"
    assert resolve("auto", PAPER, platform="gpu", head_dim=320).name == "xla"


def test_a_jax_without_the_triton_lowering(monkeypatch):
    """Once JAX drops Pallas' Triton backend: `pallas_gpu` refuses and says what runs instead,
    `auto` takes Mosaic GPU on Hopper and XLA elsewhere, and the Mosaic GPU decode entry
    keeps what its own kernel takes (bf16/fp16, head dims 64, 80, 96, 128 and 256)."""
    from cca_jax.attention import pallas_gpu, pallas_mosaic_gpu
    monkeypatch.setattr(pallas_gpu, "triton_lowering_available", lambda: False)
    monkeypatch.setattr(pallas_mosaic_gpu, "gpu_capability", lambda: 9.0)
    assert "no Pallas Triton backend" in BACKENDS["pallas_gpu"].supports(
        PAPER, "gpu", "bfloat16", 128, False)
    with pytest.raises(ValueError, match="no Pallas Triton backend.*implementation='auto'"):
        resolve("pallas_gpu", PAPER, platform="gpu")
    assert resolve("auto", PAPER, platform="gpu").name == "mosaic_gpu"
    assert resolve("auto", PAPER, platform="gpu", dtype="float32").name == "xla"
    mosaic = BACKENDS["mosaic_gpu"]
    assert mosaic.supports(PAPER, "gpu", "bfloat16", 128, False, "decode") is None
    assert mosaic.supports(PAPER, "gpu", "bfloat16", 96, False, "decode") is None
    assert "head_dim" in mosaic.supports(PAPER, "gpu", "bfloat16", 72, False, "decode")
    assert decode_backend("auto", PAPER, head_dim=72, dtype="bfloat16",
                          platform="gpu").name == "xla"
    monkeypatch.setattr(pallas_mosaic_gpu, "gpu_capability", lambda: 8.0)
    assert resolve("auto", PAPER, platform="gpu").name == "xla"

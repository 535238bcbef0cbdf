"""jax's Mosaic GPU interpreter, as the kernels' `interpret=` argument selects it."""

from __future__ import annotations


def interpret_params(interpret):
    """None (compile for the GPU), or the GPU interpreter's params for `interpret` (True:
    its defaults; an `InterpretGPUParams` is passed through)."""
    if interpret is None or interpret is False:
        return None
    if interpret is True:
        from jax.experimental.pallas import mosaic_gpu as plgpu
        params = getattr(plgpu, "InterpretGPUParams", None)   # public from jax 0.11
        if params is None:                                    # jax 0.10: private only
            from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
        return params()
    return interpret

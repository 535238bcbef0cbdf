"""`benchmarks/inference.py` with the Mosaic GPU decode kernel's defaults replaced by a
tiling: the kernel's options measured in the model, not per call (research only; the
library takes its tilings from `pallas_kernels.mosaic_gpu.decode_config.decode_config`).

    python benchmarks/research/decode_tiling_inference.py --tiling '{"edge_masks_only": true}'
        [benchmarks/inference.py's arguments]

The fields given become `MosaicDecodeConfig`'s defaults for this process, so every decode
config built without them (the model's, the server's) takes them; each record's command is
this script's, `--tiling` included.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _REPO)   # the repository root: benchmarks.*, cca_jax


def use_tiling(tiling: dict) -> None:
    """Make `tiling` (MosaicDecodeConfig fields, checked by `decode_config`) the defaults."""
    from pallas_kernels.mosaic_gpu import decode_config as decode
    decode.decode_config(**tiling)        # a ValueError naming a bad field or value
    fields = decode.MosaicDecodeConfig._fields
    defaults = dict(zip(fields, decode.MosaicDecodeConfig.__new__.__defaults__))
    defaults.update(tiling)
    decode.MosaicDecodeConfig.__new__.__defaults__ = tuple(defaults[f] for f in fields)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiling", required=True, help="JSON object of MosaicDecodeConfig fields")
    args, rest = ap.parse_known_args(argv)
    tiling = json.loads(args.tiling)
    use_tiling(tiling)
    from benchmarks import inference
    inference.main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())

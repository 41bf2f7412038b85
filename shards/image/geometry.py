"""The resize rules build-shards and the loader share: Pillow's filters by name, the reducing
gap, and the DCT scale libjpeg may decode a JPEG at.

Torch-free, beside the decode policy (`shards.image.policy`). `preprocess.images` sizes the
build's resize with them; `pipeline.decode` and `pipeline.fast_transforms` the loader's crops.
"""

from __future__ import annotations

from PIL import Image

RESAMPLING = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}
# A box at least this many times the output is first box-reduced by an integer factor
# (Pillow's `reducing_gap`): cheap for large PNG/WEBP sources, which have no DCT scaling.
REDUCING_GAP = 2.0
DCT_SCALES = (8, 4, 2)  # what libjpeg can decode to directly: 1/8, 1/4, 1/2


def dct_scale(room: float) -> int:
    """The largest DCT scale divisor (8, 4 or 2) not above `room`, else 1 (a full decode).

    `room` is how many times the source region covers the output on its tighter axis: a
    JPEG decoded at 1/`room` or larger still holds the output's pixels, so the final
    resize downsamples and the geometry is that of a full decode.
    """
    for scale in DCT_SCALES:
        if room >= scale:
            return scale
    return 1

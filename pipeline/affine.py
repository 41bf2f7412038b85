"""Affine maps as six floats (a, b, c, d, e, f): the point (a x + b y + c, d x + e y + f).

Pillow's `Image.transform` matrices read that way in its pixel-edge frame, OpenCV's
`warpAffine(..., WARP_INVERSE_MAP)` in pixel centres. The loader's crops and the
augmentation ops compose them once per crop; plain floats, because numpy's small-array
calls cost more than the arithmetic. Torch- and OpenCV-free.
"""

from __future__ import annotations

from collections.abc import Sequence

Matrix = tuple[float, float, float, float, float, float]  # (a, b, c, d, e, f), Pillow's order


def centre_matrix(matrix: Sequence[float]) -> Matrix:
    """Pillow's `matrix` in pixel-centre coordinates: output pixel (x, y) reads input point
    (a x + b y + c, d x + e y + f), as `cv2.warpAffine` with `WARP_INVERSE_MAP` reads its
    2 x 3 matrix (Pillow's frame has pixel i spanning [i, i + 1))."""
    a, b, c, d, e, f = map(float, matrix)
    return (a, b, c + (a + b) / 2 - 0.5, d, e, f + (d + e) / 2 - 0.5)


def compose(matrices: Sequence[Sequence[float]]) -> Matrix | None:
    """Affine matrices composed, each reading through the next: the point m1 . (m2 . (...
    p)); None for none. Pillow's and pixel-centre matrices alike; plain floats, as these
    run once per crop, where numpy's small-array calls cost more than the arithmetic."""
    if not matrices:
        return None
    a, b, c, d, e, f = map(float, matrices[0])
    for a2, b2, c2, d2, e2, f2 in matrices[1:]:
        a, b, c, d, e, f = (
            a * a2 + b * d2,
            a * b2 + b * e2,
            a * c2 + b * f2 + c,
            d * a2 + e * d2,
            d * b2 + e * e2,
            d * c2 + e * f2 + f,
        )
    return (a, b, c, d, e, f)

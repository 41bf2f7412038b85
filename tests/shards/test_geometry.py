"""Tests of the resize rules build-shards and the loader share (`shards.image.geometry`)."""

from __future__ import annotations

import pytest
from PIL import Image

from pipeline.decode import draft_scale
from preprocess.images import RESAMPLE_CHOICES, ImageConfig, draft_request
from shards.image.geometry import DCT_SCALES, RESAMPLING, dct_scale


@pytest.mark.parametrize(
    "room,scale", [(0.5, 1), (1.99, 1), (2.0, 2), (3.99, 2), (4.0, 4), (7.9, 4), (8.0, 8), (1e6, 8)]
)
def test_dct_scale_is_the_largest_scale_the_room_allows(room, scale):
    assert dct_scale(room) == scale
    assert scale == 1 or scale in DCT_SCALES


def test_build_filters_are_the_shared_ones_but_nearest():
    assert set(RESAMPLE_CHOICES) == set(RESAMPLING) - {"nearest"}
    assert RESAMPLING["lanczos"] is Image.Resampling.LANCZOS


@pytest.mark.parametrize("width,height", [(1792, 1344), (896, 672), (512, 384), (600, 400)])
def test_build_and_loader_pick_one_dct_scale_where_the_sides_divide(width, height):
    # Where the source divides evenly, the build's whole-image draft request and the loader's
    # box rule are the same rule: the largest scale that keeps the output's pixels.
    config = ImageConfig(image_size=224, resize="shorter", backend="pillow")
    request = draft_request(width, height, config)
    build = 1 if request is None else dct_scale(min(width // request[0], height // request[1]))
    assert build == draft_scale(width, height, (round(224 * width / height), 224))

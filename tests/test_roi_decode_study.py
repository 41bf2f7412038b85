"""benchmarks/roi_decode.py runs and measures the shipped crop (a tiny run, no timing claims)."""

import pytest

pytest.importorskip("simplejpeg")
pytest.importorskip("cv2")

from benchmarks import roi_decode  # noqa: E402


@pytest.mark.timeout(60)
def test_the_study_runs_and_its_fast_row_is_the_loaders_crop(capsys):
    # main() checks first that its 'fast' variant gives FastRandomResizedCrop's pixels.
    assert (
        roi_decode.main(["--images", "2", "--draws", "3", "--rounds", "1", "--sides", "512"]) == 0
    )
    table = capsys.readouterr().out
    for variant in ("| fast | 512 |", "| no-dct-scale | 512 |", "| fast-flags | 512 |"):
        assert variant in table
    assert "| no-dct-scale | 512 | " in table and "exact | exact | never |" in table


def test_lossless_crop_keeps_edge_mcus_and_moves_the_box():
    class Recorder:
        def crop(self, data, x, y, w, h, preserve):
            self.args = (x, y, w, h, preserve)
            return b"cut"

    cropper = Recorder()
    # A box reaching the right and bottom edges of a 341 x 256 4:2:0 image.
    cut, box, width, height = roi_decode.lossless_crop(
        cropper, b"jpeg", (100.5, 40.2, 341.0, 256.0), 341, 256, "420"
    )
    assert cropper.args == (96, 32, 245, 224, True)  # starts on a 16 px MCU, ends at the edge
    assert (cut, width, height) == (b"cut", 245, 224)
    assert box == pytest.approx((4.5, 8.2, 245.0, 224.0))

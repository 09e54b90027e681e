"""The HTML report, opened in headless Chromium: the latency plots really render."""

import shutil
import subprocess

import pytest

from tests.helpers import REPORT
from replay_proxy.report.render import write_reports

CHROMIUM = shutil.which("chromium")
BASELINE, CANDIDATE = (0x3B, 0x6E, 0xA8), (0xD9, 0x62, 0x2B)  # the plot's two line colours
REGRESSION = (0xC0, 0x39, 0x2B)  # a regression's point and interval in the forest plot


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (scripts/test.sh installs it)")
def test_report_renders_both_latency_curves_and_the_forest_plot(tmp_path):
    from PIL import Image

    write_reports(REPORT, tmp_path)
    shot = tmp_path / "report.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,1000",
                    f"--screenshot={shot}", f"file://{tmp_path / 'report.html'}"],
                   check=True, capture_output=True, timeout=120)
    pixels = list(Image.open(shot).convert("RGB").get_flattened_data())

    def near(colour):
        return sum(all(abs(p - c) < 30 for p, c in zip(pixel, colour)) for pixel in pixels)

    assert near(BASELINE) > 100 and near(CANDIDATE) > 100  # both CDF lines are drawn
    assert near(REGRESSION) > 30  # the regression's interval in the forest plot

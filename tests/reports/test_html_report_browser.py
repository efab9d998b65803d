"""The HTML report of a red run, opened in a real headless Chromium (fixtures/browser.py): what someone who opens it
on a failed build must see on its first screen, in the screenshot itself, and that the page asks nothing of the
network.

The run is real and small (pytester, in this process): write-up 002's "before" loader against one check it fails
(fp16-unscale: it loads float16 weights for training) and one it passes (the offloaded inference load)."""

from __future__ import annotations

import io

import pytest

from pytest_llmload.failures.fp16_unscale import FAILURE
from pytest_llmload.reports.html_pictures import DEVICE_COLOURS

FAILING, PASSING = "check_fp16_train_request_keeps_fp32_master_weights", "check_offload_inference"
RUN = ("--pyargs", "pytest_llmload.suite", "-p", "no:cacheprovider", "-k", f"{FAILING} or {PASSING}",
       "--llmload-loader", "fixtures.loaders.before_meta_backward:load", "--llmload-html", "report.html")
# The size bound: the reference loader's main job has 10 tests that load a model, and its report is under 500 KB
# (docs/html_report.md); a report with pictures is held to that rate.
BYTES_PER_PICTURED_TEST = 50_000
PAGE = 20_000  # the header, the CSS, the rows


def _colour_share(screenshot, box: dict, colour: str) -> float:
    """The share of the pixels inside ``box`` (CSS pixels, the screenshot's own at this scale) near ``colour``."""
    from PIL import Image

    want = tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))
    image = Image.open(io.BytesIO(screenshot)).convert("RGB")
    crop = image.crop((int(box["x"]), int(box["y"]), int(box["x"] + box["width"]), int(box["y"] + box["height"])))
    data = crop.tobytes()
    pixels = list(zip(data[0::3], data[1::3], data[2::3]))
    near = sum(1 for pixel in pixels if max(abs(a - b) for a, b in zip(pixel, want)) <= 24)
    return near / max(1, len(pixels))


@pytest.mark.timeout(120)
def test_a_red_report_shows_the_failure_its_fix_and_its_pictures_on_the_first_screen(pytester, browser_page):
    result = pytester.runpytest(*RUN)
    result.assert_outcomes(failed=1, passed=1, skipped=2)  # (the _cuda variants need a GPU)
    report = pytester.path / "report.html"
    assert report.stat().st_size < PAGE + 2 * BYTES_PER_PICTURED_TEST  # both checks loaded a model

    requests: list[str] = []
    browser_page.on("request", lambda request: requests.append(request.url))
    browser_page.goto(report.as_uri())
    card = browser_page.locator(f'section.card[data-check="{FAILING}"]')
    title, finding, fix = card.locator("h3"), card.locator(".finding .sentence"), card.locator(".fix")
    device_map = card.locator("figure.device-map img").first
    assert FAILING in title.inner_text() and "failed" in title.inner_text()
    assert "Attempting to unscale FP16 gradients" in finding.inner_text()  # the finding, as the terminal gives it
    assert f"fix ({FAILURE.id}): {FAILURE.fix}" in " ".join(fix.inner_text().split())  # the fix, as the terminal
    assert device_map.evaluate("img => img.complete && img.naturalWidth") > 0  # the picture decoded

    # The passing row is collapsed below the failure, its verdict counted where it can be seen.
    rest = browser_page.locator("details.rest")
    assert rest.evaluate("details => details.open") is False
    assert browser_page.locator(f'tr[data-check="{PASSING}"]').is_hidden()
    assert "passed" in rest.locator("summary").inner_text()

    screenshot = browser_page.screenshot()  # the first screen: 1400 x 1000
    screen = browser_page.viewport_size
    for element in (title, finding, fix, device_map):
        box = element.bounding_box()
        assert box is not None and box["width"] > 0 and box["height"] > 0
        assert 0 <= box["x"] and box["x"] + box["width"] <= screen["width"], box
        assert 0 <= box["y"] and box["y"] + box["height"] <= screen["height"], box  # whole on the first screen
    # In the pixels themselves: the fix's green box, and the device map's cpu bar (the model was loaded whole on cpu).
    assert _colour_share(screenshot, fix.bounding_box(), "#dafbe1") > 0.5
    assert _colour_share(screenshot, device_map.bounding_box(), DEVICE_COLOURS["cpu"]) > 0.05
    assert requests and all(url.startswith(("file:", "data:")) for url in requests), requests

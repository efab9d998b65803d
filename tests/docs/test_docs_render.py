"""The docs site as a reader sees it: built with ``mkdocs build --strict`` and opened in a headless Chromium
(``browser_page``, fixtures/browser.py). Wide tables fit the content column, or scroll inside their own box, and never
cut the page (docs/css/tables.css); a failure page's Fix section links each helper it names to its entry on the API
page (docs/hooks.py). The first screen of the home page and of a failure page is saved as a screenshot in the test's
tmp dir; ``LLMLOAD_DOCS_SCREENSHOTS=docs/images`` writes the committed ones (docs-index.png, docs-failure-page.png).

Skips where MkDocs is not installed (``pip install -e '.[docs]'``; the ``test`` extra includes it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urldefrag

import pytest

from pytest_llmload.failures import CATALOG

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS_ENV = "LLMLOAD_DOCS_SCREENSHOTS"
# A failure page whose Fix names two helpers, the second after a slash.
FAILURE = "adapter-on-offloaded"
FAILURE_HELPERS = {"adapter_placement_kwargs": "pytest_llmload.fixes.adapters.adapter_placement_kwargs",
                   "put_adapter": "pytest_llmload.fixes.adapters.put_adapter"}
WIDTHS = (1400, 1000)  # a desktop screen, and a laptop's half-width window

# Each table of the main column: its width against the column's, and the nearest box (itself included) that scrolls
# sideways. A table whose cells never wrap is wider than the column; one cut off has no box of its own to scroll in.
TABLES = """() => {
  const column = document.querySelector('div[role=main]');
  return [...column.querySelectorAll('table')].map(table => {
    let box = table;
    while (box !== column && !['auto', 'scroll'].includes(getComputedStyle(box).overflowX)) box = box.parentElement;
    return {width: Math.max(table.scrollWidth, table.getBoundingClientRect().width), column: column.clientWidth,
            scrolls: box !== column && box.clientWidth <= column.clientWidth + 1,
            header: table.querySelector('tr').innerText.replace(/\\s+/g, ' ').slice(0, 80)};
  });
}"""
PAGE_OVERFLOW = "() => document.documentElement.scrollWidth - window.innerWidth"
# The links in a section: from its heading to the next heading of its level.
SECTION_LINKS = """id => {
  const heading = document.getElementById(id), links = [];
  for (let node = heading.nextElementSibling; node && node.tagName !== heading.tagName; node = node.nextElementSibling)
    links.push(...[...node.querySelectorAll('a')].map(a => ({text: a.innerText, href: a.href})));
  return links;
}"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="needs MkDocs to build the docs site: pip install -e '.[docs]'")
    site_dir = tmp_path_factory.mktemp("site")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return site_dir


def _url(site: Path, page: str) -> str:
    return (site / page / "index.html").as_uri()


def _screenshot(page, name: str, tmp_path: Path) -> None:
    """The first screen, in the test's tmp dir and, where LLMLOAD_DOCS_SCREENSHOTS names a folder, there too."""
    folders = [tmp_path] + ([ROOT / os.environ[SCREENSHOTS_ENV]] if os.environ.get(SCREENSHOTS_ENV) else [])
    for folder in folders:
        page.screenshot(path=str(folder / name))


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize(("page_path", "screenshot", "wide_table"), [
    ("", "docs-index.png", "id failure write-up or field reports where it occurs reproduced here by"),
    (f"failures/{FAILURE}", "docs-failure-page.png", None),  # its first table: id, write-up, where it occurs, homes
    ("reference/settings", None, "option ini key type default help"),
], ids=["index", "failure-page", "settings"])
def test_no_table_is_cut_off(site, browser_page, tmp_path, width, page_path, screenshot, wide_table):
    browser_page.set_viewport_size({"width": width, "height": 1000})
    browser_page.goto(_url(site, page_path))
    tables = browser_page.evaluate(TABLES)
    assert tables, f"{page_path or 'index'}: no table"
    assert browser_page.evaluate(PAGE_OVERFLOW) <= 0, "the page itself scrolls sideways"
    for table in tables:
        assert table["width"] <= table["column"] + 1 or table["scrolls"], f"cut off: {table}"
    # the table this page is read for wraps inside the column: nothing to scroll for
    named = next(t for t in tables if wide_table is None or " ".join(t["header"].split()).startswith(wide_table))
    assert named["width"] <= named["column"] + 1, f"wider than the column at {width} px: {named}"
    if screenshot and width == 1400:
        _screenshot(browser_page, screenshot, tmp_path)


def test_the_fix_section_links_the_helpers_it_names(site, browser_page):
    browser_page.goto(_url(site, f"failures/{FAILURE}"))
    links = {link["text"].rpartition(".")[2]: link["href"] for link in browser_page.evaluate(SECTION_LINKS, "fix")}
    for name, anchor in FAILURE_HELPERS.items():
        assert name in links, f"{name} is not a link in the Fix section of {FAILURE}: {links}"
        page, fragment = urldefrag(links[name])
        assert page == _url(site, "reference/api").removesuffix("index.html") and unquote(fragment) == anchor


def test_every_link_in_a_fix_section_reaches_an_entry(site, browser_page):
    """Every failure page: each ``pytest_llmload.fixes`` helper its fix names is a link, and every link of the section
    opens a page with the element it points at."""
    targets = {}
    for failure in CATALOG:
        browser_page.goto(_url(site, f"failures/{failure.id}"))
        links = browser_page.evaluate(SECTION_LINKS, "fix")
        named = set(re.findall(r"pytest_llmload\.fixes\.[\w.]*\w", failure.fix))
        assert named <= {link["text"] for link in links}, f"{failure.id}: {named} not all linked in {links}"
        for link in links:
            targets.setdefault(urldefrag(link["href"])[0], set()).add(unquote(urldefrag(link["href"])[1]))
    assert targets, "no fix links a helper"
    for page, fragments in targets.items():
        browser_page.goto(page if page.endswith(".html") else page + "index.html")
        missing = [f for f in fragments if f and not browser_page.evaluate("id => !!document.getElementById(id)", f)]
        assert not missing, f"{page}: no element with the id {missing}"

"""Pictures of where each model went and of memory per phase, in a self-contained HTML report.

``--llmload-html PATH`` (ini ``llmload_html``) writes one HTML file at the end of the session: a header (the loader,
the stack's versions, when and how long, counts by verdict); then each failing row (failed, error, then predicted)
as a card: its finding (the row's sentence, as the main job prints it), the known failure it names and its fix (the
row's ``fix``, as the main job and JUnit give it; the catalog's field reports linked), and its pictures; then every
other row collapsed (``<details>``) in one table, with their pictures below it. For each test that loaded a model,
two figures drawn with matplotlib (Agg): where its models went (one picture per placement, a bar per device,
cpu/disk/meta included, its bytes and the modules on it; the loads that had it listed below) and the memory of
each phase, its axis starting near the lowest value shown. A picture is embedded once, where it first appears: a
later one with the same input data (hashed, :class:`_Pictures`) says "same picture as" and links to it.
For each prediction (``--llmload-runner``), where the model would go on the runner instead: a bar per device
filled against its capacity, the modules it holds on it, the predicted failure beside it (:func:`prediction_html`,
plain HTML and CSS from the row's :attr:`~pytest_llmload.reports.row.Row.prediction`; the stand-in loads of a
prediction are this process's, and are not drawn). CSS and images are inline (palette PNG data URIs): the file can
be mailed or kept as a CI artifact alone.

With pytest-html in the run (``--html``), the same PNGs go into its report as extras (``report.extras``, the API
pytest-html documents), whether or not ``--llmload-html`` is given.

Nothing is computed twice: the device maps are those :mod:`.phases` recorded when each model was loaded
(``LoadedModel.device_map``, ``hf_device_map`` at load), the memory is each phase's record (``Phase.as_dict``),
both taken from the test's :class:`~.phases.PhaseRecorder` that :mod:`.report` keeps. The bytes on each device are
the checkpoint's tensors (read from its safetensors headers) under each ``hf_device_map`` entry: the weights as
stored, before any cast or quantization at load.

This module is the plugin and the page; what a test's record holds (its children's included) is
:mod:`.html_data`'s, the pictures :mod:`.html_pictures`'.

Every test's row is the progress file's (:func:`~pytest_llmload.reports.progress.row_of_report`), taken as it is: a
check's carries what it saw (:attr:`~pytest_llmload.reports.row.Row.artefacts`, its isolated children's included,
on its report's properties); a test that runs no check puts its record (plain data) on its teardown report as
``report.llmload_html``. pytest serialises both for xdist (``pytest_report_to_serializable``), so the controller
receives them in ``pytest_runtest_logreport``, as pytest-html's controller receives ``report.extras``. Only the
controller (or a run without xdist) writes the file.

A run without ``--llmload-html`` or ``--html`` does nothing here; matplotlib is imported only to draw.
"""

from __future__ import annotations

import base64
import hashlib
import html
import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest

from pytest_llmload.config.distribution import FIELD_REPORT_URL
from pytest_llmload.config.stash_keys import interrupted_key
from pytest_llmload.reports.known_failures import SECTION as KNOWN_FAILURE_SECTION
from pytest_llmload.reports.html_data import record_from, record_of
from pytest_llmload.reports.html_pictures import (
    device_colour,
    device_map_figure,
    figures,
    load_line,
    memory_figure,
    memory_rows,
    memory_text,
    placement,
    placement_text,
    placements,
)
from pytest_llmload.reports.row import Row
from pytest_llmload.placement.picture import placement_tiers
from pytest_llmload.system.output_files import open_output, unsafe_reason
from pytest_llmload.system.sizes import format_bytes

RECORD_ATTRIBUTE = "llmload_html"  # the report attribute a worker's record travels in
INSTALL_HINT = "pip install 'pytest-llmload[report]'"
PLUGIN_NAME = "llmload-html-report"

state_key = pytest.StashKey["HtmlReport"]()


def matplotlib_available() -> bool:
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # a None in sys.modules (blocked), or a module without a spec
        return False


# --- configuration ----------------------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    from pytest_llmload.config import settings

    path = settings.value(config, "html")
    pytest_html = bool(config.getoption("htmlpath", None)) and config.pluginmanager.hasplugin("html")
    if not path and not pytest_html:
        return
    drawing = matplotlib_available()
    if path and not drawing:
        raise pytest.UsageError(f"--llmload-html draws its figures with matplotlib, which is not installed: "
                                f"{INSTALL_HINT}")
    target = None
    if path:
        target = Path(os.path.expandvars(path)).expanduser()
        target = target if target.is_absolute() else Path(config.invocation_params.dir) / target
        unsafe = unsafe_reason(target)
        if unsafe is not None:  # (said before the run, not after it)
            raise pytest.UsageError(f"{settings.given(config, 'html')[1]} {path!r} {unsafe}")
    state = config.stash[state_key] = HtmlReport(config, target, extras=pytest_html and drawing,
                                                 missing_matplotlib=pytest_html and not drawing)
    config.pluginmanager.register(state, PLUGIN_NAME)


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(state_key, None)
    if state is not None and config.pluginmanager.is_registered(state):
        config.pluginmanager.unregister(state)


# --- per test: the record, and pytest-html's extras --------------------------------------------------------


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    state = item.config.stash.get(state_key, None)
    if state is None or not state.active or call.when not in ("call", "teardown"):
        return report
    if call.when == "call" and not state.extras:
        return report
    row = Row.of_report(report) or Row.of_report(item)  # a check's row (its item keeps the row's properties too)
    if _is_prediction(row):  # (its loads are stand-ins: this process's memory)
        return report
    if row is not None:  # a check's: what its row carries (its isolated children's included), no record of its own
        record = record_from(row.artefacts) if call.when == "call" and row.artefacts else None
    else:  # a test that runs no check: its recorder's, at its teardown (on its report: xdist carries it)
        record = record_of(item)
    if record is None:
        return report
    if call.when == "teardown":
        setattr(report, RECORD_ATTRIBUTE, record)
    elif record["models"]:
        # pytest-html's convention: extras on the call report, in a makereport hookwrapper.
        from pytest_html import extras

        report.extras = [*getattr(report, "extras", []),
                         *(extras.png(base64.b64encode(png).decode("ascii"), name)
                           for name, png in figures(record, report.nodeid))]
    return report


# --- the session: rows, and the file ---------------------------------------------------------------------


class HtmlReport:
    """The run's rows (in the xdist controller, from the workers' reports) and the file written at its end."""

    def __init__(self, config: pytest.Config, path: Optional[Path], *, extras: bool, missing_matplotlib: bool) -> None:
        self.config = config
        self.path = path
        self.extras = extras
        self.missing_matplotlib = missing_matplotlib
        self.rows: dict[str, dict] = {}
        self.started = time.time()
        self.written: Optional[str] = None
        self.write_error: Optional[str] = None

    @property
    def active(self) -> bool:
        """Whether anything is drawn: the file, or pytest-html's extras."""
        return self.path is not None or self.extras

    @property
    def collects(self) -> bool:
        return self.path is not None and not hasattr(self.config, "workerinput")

    def _row(self, nodeid: str) -> dict:
        """A test's entry: its row (:class:`~pytest_llmload.reports.row.Row`, the progress file's), its pictures'
        record, the known failure a test that runs no check matched, and its phases' seconds so far."""
        return self.rows.setdefault(nodeid, {"nodeid": nodeid, "row": None, "record": None, "known": "",
                                             "seconds": 0.0})

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not self.collects:
            return
        row = self._row(report.nodeid)
        row["seconds"] += report.duration
        from pytest_llmload.reports.progress import row_of_report  # (not at import: a plain run imports this module)

        decided = row_of_report(report, row["seconds"])  # taken as it is: the progress file's
        if decided is not None:
            row["row"] = decided
            if decided.artefacts:  # a check's: what its row carries
                row["record"] = record_from(decided.artefacts)
        # A test that is not a check: the known failure its text matched, as pytest's report section says it.
        row["known"] = next((text for name, text in report.sections if name == KNOWN_FAILURE_SECTION), row["known"])
        record = getattr(report, RECORD_ATTRIBUTE, None)  # a test's that runs no check
        if record is not None:
            row["record"] = record

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if self.collects and report.failed:
            row = self._row(report.nodeid or "(collection)")
            row["row"] = Row(check=row["nodeid"], verdict="error", sentence=_first_line(report.longreprtext),
                             seconds=0.0)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not self.collects:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            rows = [row for row in self.rows.values() if row["row"] is not None]  # (a test that never ended: none)
            page = render_html(self.config, rows, self.started, time.time())
            with open_output(self.path) as report:  # (no link another user made)
                report.write(page)
            self.written = str(self.path)
        except OSError as exc:
            self.write_error = f"{type(exc).__name__}: {exc}"

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if hasattr(self.config, "workerinput"):
            return
        if self.written:
            terminalreporter.write_sep("-", f"llmload: HTML report: {Path(self.written).as_uri()}")
        elif self.write_error:
            terminalreporter.write_sep("-", f"llmload: the HTML report was not written: {self.write_error}", red=True)
        if self.missing_matplotlib:
            terminalreporter.write_line(f"llmload: no pictures in pytest-html's report: matplotlib is not installed "
                                        f"({INSTALL_HINT})")


def _first_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("E ")]
    return (errors[0][1:].strip() if errors else lines[-1] if lines else "")[:300]


VERDICT_COLOURS = {"passed": "#1a7f37", "failed": "#cf222e", "error": "#b35900", "predicted": "#8250df",
                   "skipped": "#6e7781", "not exercised": "#6e7781", "xfailed": "#6e7781", "xpassed": "#b35900"}
# The rows a red build is opened for: first, each as a card, in this order. Every other row is collapsed below them.
CARDS = ("failed", "error", "predicted")
FIELD_REPORT = re.compile(r"\b([\w.-]+/[\w.-]+)#(\d+)\b")  # a catalog's field report: owner/repo#number

CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif; color: #1f2328;
       margin: 24px auto; max-width: 1200px; padding: 0 16px; }
h1 { font-size: 26px; margin: 0 0 6px; }
h2 { font-size: 20px; margin: 24px 0 10px; border-bottom: 1px solid #d0d7de; padding-bottom: 4px; }
h3 { font-size: 17px; margin: 22px 0 6px; word-break: break-all; }
h4 { font-size: 14px; margin: 14px 0 4px; }
.meta { color: #424a53; margin: 2px 0; }
.interrupted { background: #fff8c5; border: 1px solid #d4a72c; padding: 6px 10px; }
.counts span { display: inline-block; margin: 6px 8px 0 0; }
table { border-collapse: collapse; width: 100%; font-size: 14px; table-layout: fixed; }
col.c-test { width: 33%; } col.c-verdict { width: 49%; } col.c-failure { width: 11%; } col.c-seconds { width: 7%; }
th, td { border: 1px solid #d0d7de; padding: 5px 8px; text-align: left; vertical-align: top; }
th { background: #f6f8fa; }
td.num { text-align: right; white-space: nowrap; font-variant-numeric: tabular-nums; }
td.test, td.failure { overflow-wrap: anywhere; }
.verdict { display: inline-block; color: #fff; border-radius: 10px; padding: 1px 9px; font-size: 13px;
           font-weight: 600; white-space: nowrap; }
.sentence { white-space: pre-wrap; overflow-wrap: anywhere; color: #424a53; font-size: 13px; margin-top: 3px; }
code { font-size: 13px; }
figure { margin: 6px 0 14px; }
figure img { max-width: 100%; height: auto; border: 1px solid #d0d7de; display: block; }
figcaption { color: #57606a; font-size: 13px; }
figcaption ul { margin: 2px 0; padding-left: 20px; }
a { color: #0969da; }
.card { border: 1px solid #d0d7de; border-left: 6px solid #cf222e; border-radius: 6px; padding: 4px 18px 8px;
        margin: 12px 0 22px; }
.card.error { border-left-color: #b35900; } .card.predicted { border-left-color: #8250df; }
.card h3 { margin-top: 10px; }
.label { font-weight: 600; color: #1f2328; }
.finding .sentence { font: 13px/1.45 ui-monospace, "DejaVu Sans Mono", monospace; color: #1f2328;
                     background: #fff5f5; border: 1px solid #ffcecb; border-radius: 4px; padding: 8px 10px; }
.fix { background: #dafbe1; border: 1px solid #aceebb; border-radius: 4px; padding: 6px 10px; margin: 10px 0; }
.fix p { margin: 3px 0; }
.fix pre { white-space: pre-wrap; margin: 0; font-size: 13px; }
.notes { color: #424a53; font-size: 13px; }
.same { color: #57606a; font-size: 13px; margin: 2px 0; font-style: italic; }
details.rest { margin: 24px 0; }
details.rest > summary { cursor: pointer; font-size: 20px; font-weight: 600; padding: 4px 0;
                         border-bottom: 1px solid #d0d7de; }
details.rest > summary .verdict { font-size: 13px; vertical-align: middle; }
details.rest > summary > span { margin-left: 10px; font-size: 15px; }
.prediction { display: flex; gap: 16px; align-items: flex-start; margin: 6px 0 18px; }
.pred-bars { flex: 3; min-width: 0; }
.pred-verdict { flex: 1; min-width: 0; border-left: 3px solid #8250df; padding: 2px 0 2px 10px; font-size: 14px; }
.prediction[data-failure=""] .pred-verdict { border-left-color: #1a7f37; }
.device { display: flex; align-items: center; gap: 8px; margin: 4px 0; font-size: 13px; }
.device .dev { width: 56px; font-weight: 600; text-align: right; flex: none; }
.device .bar { position: relative; flex: 1; height: 22px; background: #f6f8fa; border: 1px solid #8c959f;
               border-radius: 3px; overflow: hidden; min-width: 0; }
.device.over .bar { border: 2px solid #cf222e; }
.device .bar .peak, .device .bar .weights { position: absolute; left: 0; top: 0; bottom: 0; }
.device .bar .peak { background: #d0d7de; }
.device .bar .holds { position: absolute; left: 6px; right: 6px; top: 2px; white-space: nowrap; overflow: hidden;
                      text-overflow: ellipsis; color: #1f2328; text-shadow: 0 0 3px #fff, 0 0 3px #fff; }
.device .figures { width: 250px; flex: none; font-variant-numeric: tabular-nums; color: #424a53; }
.device.over .figures b { color: #cf222e; }
"""


def _severity(kind: str) -> tuple[int, str]:
    order = ("failed", "error", "predicted", "xpassed", "not exercised", "passed", "skipped", "xfailed")
    return (order.index(kind) if kind in order else len(order), kind)


def _row_severity(row: dict) -> tuple[int, str]:
    return _severity(_verdict_of(row)[0])


def _badge(kind: str) -> str:
    return (f'<span class="verdict" style="background:{VERDICT_COLOURS.get(kind, "#57606a")}">'
            f"{html.escape(kind)}</span>")


def _verdict_of(row: dict) -> tuple[str, str, str]:
    """(verdict, the known failure column, sentence) of a test's row, as it is."""
    check_row = row["row"]
    failure = check_row.failure or (f"guards {check_row.guards}" if check_row.guards else "")
    return check_row.verdict, failure, check_row.sentence


def _name(row: dict) -> str:
    """A row's name: its row's (a check's own name, a repo's check's too)."""
    return row["row"].check


def _seconds(row: dict) -> str:
    seconds = row["row"].seconds
    return f"{seconds:.2f}" if seconds is not None else "?"


def _anchor(nodeid: str) -> str:
    return "t-" + re.sub(r"[^A-Za-z0-9_-]+", "-", nodeid).strip("-")


class _Pictures:
    """The pictures already in the file, by what they show (a hash of the figure's input data, never of its PNG):
    each is drawn and embedded once; a later row with the same one refers to it."""

    def __init__(self) -> None:
        self.first: dict[str, str] = {}  # key: the row that shows it

    def html(self, data: Any, draw, alt: str, row_name: str) -> str:
        key = hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:16]
        if key in self.first:
            return (f'<p class="same">same picture as <a href="#p-{key}">{html.escape(self.first[key])}\'s</a></p>')
        png = draw()
        self.first[key] = row_name
        return (f'<img id="p-{key}" alt="{html.escape(alt)}" '
                f'src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">')


def _pictures_html(row: dict, drawn: _Pictures) -> str:
    """A test's pictures: a device map per placement, the loads that had it listed below it; its memory per phase."""
    esc, record, name = html.escape, row["record"], _name(row)
    parts = ["<h4>Where the models went</h4>"]
    if not record["models"]:  # a failing test's card: the loader raised before it returned one, say
        parts.append('<p class="same">no model came back to be drawn (the finding says where it stopped)</p>')
    for group in placements(record["models"]):
        picture = drawn.html(["device map", placement(group[0])], lambda: device_map_figure([group], titled=False),
                             f"llmload: device map: {row['nodeid']}", name)
        loads = "".join(f"<li>{esc(load_line(m))} (device map: {esc(m['map_source'])})</li>" for m in group)
        parts.append(f'<figure class="device-map">{picture}<figcaption><b>{esc(placement_text(group[0]))}</b>'
                     f"<ul>{loads}</ul></figcaption></figure>")
    memory = memory_rows(record.get("phases", []))
    if memory:
        picture = drawn.html(["memory", memory], lambda: memory_figure(memory),
                             f"llmload: memory per phase: {row['nodeid']}", name)
        parts.append(f'<h4>Memory per phase</h4><figure class="memory">{picture}'
                     f'<figcaption>{esc(memory_text(record["phases"]))}</figcaption></figure>')
    return "".join(parts)


def _fix_html(failure_id: str, fix: str) -> str:
    """The known failure a row names and its fix, in the fix's own words (the row's, as the main job and JUnit give
    it); its write-up or the field reports it comes from (linked), from the catalog where it is one of ours."""
    from pytest_llmload import failures as catalog

    esc = html.escape
    known = catalog.BY_ID.get(failure_id)
    about = ""
    if known is not None:
        about = f": {esc(known.title)}"
        if known.write_up.startswith("seeds/"):
            about += f" (write-up {esc(known.write_up.rpartition('/')[2][:3])})"
        else:
            about += "<br>field reports: " + ", ".join(
                f'<a href="{esc(FIELD_REPORT_URL.format(repo=repo, number=number))}">{esc(repo)}#{number}</a>'
                for repo, number in dict.fromkeys(FIELD_REPORT.findall(known.write_up)))
    return (f'<div class="fix"><p><span class="label">Known failure</span> <code>{esc(failure_id)}</code>{about}</p>'
            f'<p><span class="label">fix ({esc(failure_id)}):</span> {esc(fix)}</p></div>')


def _card(row: dict, drawn: _Pictures) -> str:
    """A failing row (failed, error, predicted): what failed, what was found, the known failure and its fix, and
    its pictures (a prediction's: where the model would go)."""
    esc = html.escape
    kind = _verdict_of(row)[0]
    check_row, nodeid, name = row["row"], row["nodeid"], _name(row)
    finding = check_row.finding
    guards = f" &middot; guards {esc(check_row.guards)}" if check_row.guards else ""
    parts = [f'<section class="card {esc(kind)}" id="{_anchor(nodeid)}" data-check="{esc(name)}" '
             f'data-verdict="{esc(kind)}">',
             f"<h3>{esc(name)} {_badge(kind)}</h3>",
             f'<p class="meta"><code>{esc(nodeid)}</code> &middot; {_seconds(row)} s{guards}</p>',
             f'<div class="finding"><span class="label">Finding</span><div class="sentence">{esc(finding)}</div></div>']
    if check_row.notes:
        parts.append(f'<p class="notes"><span class="label">How it was judged:</span> {esc(check_row.note)}</p>')
    if check_row.fix and check_row.failure:
        parts.append(_fix_html(check_row.failure, check_row.fix))
    elif check_row.fix:  # the loader's own error, a known loader fault (loader.faults)
        parts.append(f'<div class="fix"><p><span class="label">fix (the loader):</span> <code>{esc(check_row.fix)}'
                     '</code></p></div>')
    elif row.get("known"):  # a test that runs no check: the known failure its text matched
        parts.append(f'<div class="fix"><span class="label">Known failure</span><pre>{esc(row["known"])}</pre></div>')
    if _is_prediction(check_row):
        parts.append(prediction_html(check_row))
    elif row["record"] and (row["record"].get("models") or memory_rows(row["record"].get("phases", []))):
        parts.append(_pictures_html(row, drawn))
    return "".join(parts) + "</section>"


def _table_row(row: dict, linked: bool) -> str:
    esc = html.escape
    kind, failure, sentence = _verdict_of(row)
    nodeid, name = row["nodeid"], _name(row)
    link = f' &middot; <a href="#{_anchor(nodeid)}">pictures</a>' if linked else ""
    return (f'<tr data-check="{esc(name)}" data-verdict="{esc(kind)}"><td class="test"><b>{esc(name)}</b>{link}<br>'
            f"<code>{esc(nodeid)}</code></td><td>{_badge(kind)}"
            + (f'<div class="sentence">{esc(sentence)}</div>' if sentence else "") + "</td>"
            f"<td class=\"failure\">{esc(failure)}</td><td class=\"num\">{_seconds(row)}</td></tr>")


def _counts(rows: list[dict]) -> str:
    from collections import Counter

    kinds = Counter(_verdict_of(row)[0] for row in rows)
    return "".join(f"<span>{_badge(kind)} {kinds[kind]}</span>" for kind in sorted(kinds, key=_severity))


def render_html(config: pytest.Config, rows: list[dict], started: float, ended: float) -> str:
    """The file: the header and counts; the failing rows first, each as a card; every other row collapsed below."""
    from importlib import metadata

    from pytest_llmload.reports.header import header_lines

    esc = html.escape
    loaders = sorted({row["row"].loader for row in rows if row["row"].loader})
    head = header_lines(config)[0].removeprefix("llmload: ")
    chosen, _, stack = head.removeprefix("loader ").partition("; ")
    if loaders and chosen.split(" (from ")[0] not in loaders:  # the rows name the loader they ran
        chosen = ", ".join(loaders)
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
    cards = sorted((row for row in rows if _verdict_of(row)[0] in CARDS), key=_row_severity)
    rest = [row for row in rows if _verdict_of(row)[0] not in CARDS]
    parts = [
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        "<title>pytest-llmload report</title>", f"<style>{CSS}</style>", "</head>", "<body>",
        "<h1>pytest-llmload report</h1>",
        f'<p class="meta"><b>loader:</b> {esc(chosen)}</p>',
        f'<p class="meta"><b>stack:</b> {esc(stack)}</p>',
        f'<p class="meta"><b>python</b> {esc(sys.version.split()[0])}, <b>pytest</b> {esc(metadata.version("pytest"))}; '
        f"started {esc(when)}, took {ended - started:.1f} s; {len(rows)} test{'s' if len(rows) != 1 else ''}</p>",
        f'<p class="counts">{_counts(rows)}</p>',
    ]
    interrupted = config.stash.get(interrupted_key, None)
    if interrupted:  # (pytest_llmload.plugin.interruption: the rows below are those finished before it)
        parts.append(f'<p class="interrupted" role="alert"><b>Interrupted:</b> {esc(interrupted)}. The rows below '
                     "are the tests that finished before it.</p>")
    drawn = _Pictures()  # (in the order of the page: a picture is embedded where it is first seen)
    if cards:
        parts.append(f"<h2>Failures ({len(cards)})</h2>")
        parts += [_card(row, drawn) for row in cards]
    else:
        parts.append('<p class="meta">Nothing failed: every row is below, collapsed (click to open).</p>')
    if not rest:
        return "\n".join(parts + ["</body>", "</html>", ""])
    predictions = [row for row in rest if _is_prediction(row["row"])]
    predicted = {row["nodeid"] for row in predictions}
    pictured = [row for row in rest if row["record"] and row["record"].get("models") and row["nodeid"] not in predicted]
    linked = predicted | {row["nodeid"] for row in pictured}  # (the rows with a section below the table)
    rows_word = f"row{'s' if len(rest) != 1 else ''}"
    summary = f"{len(rest)} other {rows_word}" if cards else f"All {len(rest)} {rows_word}"
    parts += [f'<details class="rest"><summary>{summary} {_counts(rest)}</summary>',
              '<table><colgroup><col class="c-test"><col class="c-verdict"><col class="c-failure">'
              '<col class="c-seconds"></colgroup><thead><tr><th>test / check</th><th>verdict</th>'
              "<th>known failure</th><th>seconds</th></tr></thead><tbody>"]
    parts += [_table_row(row, row["nodeid"] in linked) for row in sorted(rest, key=_row_severity)]
    parts.append("</tbody></table>")
    if pictured:
        parts.append("<h2>Where the models went, and memory per phase</h2>")
        parts.append('<p class="meta">Bars: the bytes of the checkpoint\'s tensors under each device-map entry '
                     "(as stored, before any cast or quantization), and each phase's memory as recorded.</p>")
    for row in pictured:
        parts.append(f'<section id="{_anchor(row["nodeid"])}" data-check="{esc(_name(row))}">'
                     f'<h3>{esc(_name(row))} {_badge(_verdict_of(row)[0])}</h3>'
                     f"{_pictures_html(row, drawn)}</section>")
    if predictions:
        parts.append("<h2>Where the model would go: the predictions</h2>")
        parts.append('<p class="meta">Per prediction, a bar per device of the runner profile, filled by what the '
                     "planned map puts there against the device's capacity (solid: the weights; lighter: the "
                     "predicted peak of a training step or of DeepSpeed's model states), with the modules it holds; "
                     "beside it, the failure the runner would hit. Planned, not measured: nothing was loaded.</p>")
    for row in predictions:
        check_row = row["row"]
        parts.append(f'<h3 id="{_anchor(row["nodeid"])}">{esc(check_row.check)} {_badge(_verdict_of(row)[0])}</h3>'
                     + prediction_html(check_row))
    parts += ["</details>", "</body>", "</html>", ""]
    return "\n".join(parts)


def _is_prediction(row: Optional[Row]) -> bool:
    """A prediction's row: it carries where the model would go, or predicts a failure (a placement refused)."""
    return row is not None and (row.prediction is not None or row.verdict == "predicted")


def _percent(part: Optional[int], whole: Optional[int]) -> float:
    return 0.0 if not part or not whole else min(100.0, 100.0 * part / whole)


def prediction_html(check_row: Row) -> str:
    """One prediction's bar group: a bar per device filled against its capacity, the modules it holds written on it,
    and the verdict beside the bars (the failure the runner would hit, or what was found). Plain HTML and CSS: the
    figures need no drawing library."""
    esc = html.escape
    prediction = check_row.prediction or {}
    failure = check_row.failure if check_row.verdict == "predicted" else None
    head = (f'<div class="prediction" data-check="{esc(check_row.check)}" '
            f'data-runner="{esc(prediction.get("runner", ""))}" data-failure="{esc(failure or "")}">')
    bars = []
    for d in prediction.get("devices", []):
        capacity, weights, peak = d["capacity"], d["weights"], d["peak"]
        over = capacity is not None and peak is not None and peak > capacity
        holds = prediction["placement"].get(d["device"], "")
        if weights is None:
            figures = f"{d['modules']} module{'s' if d['modules'] != 1 else ''}; sizes not planned"
        else:
            figures = format_bytes(weights) + (f" (peak {format_bytes(peak)})" if peak not in (None, weights) else "")
            if capacity is not None:
                figures += f" of {format_bytes(capacity)} ({100 * (peak or weights) / capacity:.0f}%)"
        data = " ".join(f'data-{key}="{"" if value is None else value}"' for key, value in (
            ("capacity", capacity), ("weights", weights), ("peak", peak), ("modules", d["modules"])))
        bars.append(
            f'<div class="device{" over" if over else ""}" data-device="{esc(d["device"])}" {data}>'
            f'<span class="dev">{esc(d["device"])}</span>'
            f'<span class="bar" title="{esc(holds)}">'
            f'<span class="peak" style="width:{_percent(peak, capacity):.1f}%"></span>'
            f'<span class="weights" style="width:{_percent(weights, capacity):.1f}%;'
            f'background:{device_colour(d["device"])}"></span>'
            f'<span class="holds">{esc(holds)}</span></span>'
            f'<span class="figures">{esc(figures)}{" <b>OVER</b>" if over else ""}</span></div>')
    if prediction:
        what = f"{prediction['model']} on {prediction['runner']}: {placement_tiers(prediction)}"
        body = f'<p class="meta">{esc(what)}</p>' + "".join(bars)
    else:
        body = '<p class="meta">no map: the placement was not planned (the sentence says why)</p>'
    said = prediction.get("reason") or check_row.sentence
    verdict = (f'<div class="pred-verdict"><b>{esc("would hit " + failure if failure else "no failure predicted")}'
               f'</b><div class="sentence">{esc(said)}</div></div>')
    return head + f'<div class="pred-bars">{body}</div>' + verdict + "</div>"

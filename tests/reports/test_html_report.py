"""The HTML report (``--llmload-html``) and the pictures in pytest-html's report, as a user meets them (pytester):
one row per test with its verdict, the failing ones first as cards, the device map and memory of a check that
offloaded, each picture drawn once, memory axes scaled to the change, self-contained, under ``pytest -n 2`` too; and
what a run without the report leaves alone. In a real browser: tests/reports/test_html_report_browser.py."""

from __future__ import annotations

import base64
import html
import json
import re

import pytest

from fixtures import warm_runs
from pytest_llmload.instruments.device_map_summary import compress_modules
from pytest_llmload.reports.html_pictures import axis_start
from pytest_llmload.reports.html_report import render_html
from pytest_llmload.reports.row import Row

SUITE = ("--pyargs", "pytest_llmload.suite", "-p", "no:cacheprovider")
OFFLOAD = "check_offload_inference"
WRITES = "check_load_writes_only_offload_folder"
# The tiny Llama under offload_budget: the embeddings and layer 0 on cpu, the rest on disk (tests/reports/test_report).
ON_CPU = "cpu 224.5 KiB (model.embed_tokens, model.layers.0)"
ON_DISK = "disk 513.8 KiB (model.layers.1\u20133, model.norm, model.rotary_emb, lm_head)"
PNG_URI = re.compile(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"')
SAME_PICTURE = "same picture as"


def _rows(text: str) -> dict[str, str]:
    """``{check name: verdict}`` of every row: the failing rows' cards and the collapsed table's rows."""
    return dict(re.findall(r'<(?:tr|section class="card [^"]*" id="[^"]*") data-check="([^"]+)" '
                           r'data-verdict="([^"]+)"', text))


def _assert_self_contained(text: str) -> None:
    """Nothing the page loads comes from elsewhere; the only addresses are links (a known failure's field reports)."""
    assert not re.search(r'(?:src|srcset|action)="(?!data:|#)', text) and "url(" not in text, "a resource to fetch"
    assert len(re.findall(r"https?://", text)) == len(re.findall(r'<a href="https://', text)), "an address not a link"
    assert "<script" not in text and "<link" not in text, "external script or stylesheet"
    for data in PNG_URI.findall(text):
        assert base64.b64decode(data).startswith(b"\x89PNG\r\n\x1a\n")


def _pictures_of(text: str, check: str) -> str:
    """The report's section for one check: from its heading to the next one."""
    start = text.index(f">{check} <span")
    end = text.find("<h3", start)
    return text[start:end if end != -1 else len(text)]


@pytest.mark.timeout(120)
def test_the_report_has_a_row_per_test_and_pictures_of_the_offloaded_model(pytester):
    # The checks run in an isolated child: their loads come back from the child to the picture. The check that
    # watches every file the load writes passes: the child's records go through a file it opened at the fork.
    result = pytester.runpytest(*SUITE, "-k", f"{OFFLOAD} or {WRITES}", "--llmload-html", "out/report.html")
    result.assert_outcomes(passed=2, skipped=1)  # the _cuda variant needs a GPU
    result.stdout.fnmatch_lines(["*- llmload: HTML report: file://*/out/report.html -*"])
    text = (pytester.path / "out" / "report.html").read_text(encoding="utf-8")
    _assert_self_contained(text)
    assert _rows(text) == {OFFLOAD: "passed", WRITES: "passed", f"{OFFLOAD}_cuda": "skipped"}
    assert "needs 1 GPU" in text  # the skipped row says why
    assert "reference_loader:load_model_and_tokenizer" in text and "torch " in text  # loader, stack versions
    assert "<details" in text and 'class="card' not in text  # nothing failed: every row collapsed
    section = html.unescape(_pictures_of(text, OFFLOAD))
    assert len(PNG_URI.findall(section)) == 3  # two placements (offloaded, the ground truth whole), the memory
    assert f"{ON_CPU}; {ON_DISK}" in section and "LlamaForCausalLM from llama-float32-seed0 for inference on cpu, " \
        "max_memory={'cpu': 377984}" in section  # the offloading load, what it was asked
    assert "cpu 738.2 KiB (<whole model>)" in section  # the ground truth
    assert "peak process RSS" in section
    writes = html.unescape(_pictures_of(text, WRITES))  # the same offloaded placement: referred to, not drawn again
    assert f"{ON_CPU}; {ON_DISK}" in writes and SAME_PICTURE in writes and len(PNG_URI.findall(writes)) == 1
    assert f"{OFFLOAD}_cuda <span" not in text  # no pictures for a check that loaded nothing


XDIST = """
import pytest
from pytest_llmload.checks.ground_truth import offload_budget

def test_offloaded(llmload_load, llmload_checkpoint, tmp_path):
    llmload_load(max_memory=offload_budget(llmload_checkpoint), offload_folder=tmp_path / "offload")

def test_isolated_check(llmload_loader, llmload_checkpoint, tmp_path):
    from pytest_llmload.failures.offload_hang import CHECKS

    CHECKS[0](llmload_loader, llmload_checkpoint, tmp_path)  # check_offload_inference, in a forked child

def test_plain():
    pass

def test_failing():
    assert 1 == 2

@pytest.mark.skip(reason="not today")
def test_skipped():
    pass
"""


@pytest.mark.timeout(120)
def test_under_xdist_the_workers_records_reach_the_controllers_report(pytester):
    pytester.makepyfile(test_many=XDIST)
    # The controller forked from this process (fixtures/warm_runs.py); its workers are xdist's own new interpreters.
    result = warm_runs.runpytest(pytester, "-n", "2", "-p", "no:cacheprovider", "--llmload-html", "report.html")
    result.assert_outcomes(passed=3, failed=1, skipped=1)
    text = (pytester.path / "report.html").read_text(encoding="utf-8")
    _assert_self_contained(text)
    assert _rows(text) == {"test_offloaded": "passed", "test_isolated_check": "passed", "test_plain": "passed",
                           "test_failing": "failed", "test_skipped": "skipped"}
    assert "<code>test_many.py::test_failing</code>" in text
    assert "not today" in text and "assert 1 == 2" in text
    assert text.index('data-check="test_failing"') < text.index("<details")  # the failure first, as a card
    section = html.unescape(_pictures_of(text, "test_offloaded"))
    assert f"{ON_CPU}; {ON_DISK}" in section
    isolated = html.unescape(_pictures_of(text, "test_isolated_check"))  # a worker's forked child, then the controller
    assert f"{ON_CPU}; {ON_DISK}" in isolated and "cpu 738.2 KiB (<whole model>)" in isolated
    # Only the tests that loaded a model have pictures; the offloaded placement of both is drawn once.
    assert text.count('<figure class="device-map">') == 3 and text.count('<figure class="memory">') == 2
    assert len(PNG_URI.findall(text)) == 4 and text.count(SAME_PICTURE) == 1


@pytest.mark.timeout(120)
def test_pytest_html_gets_the_same_pictures_as_extras(pytester):
    pytest.importorskip("pytest_html")
    result = pytester.runpytest(*SUITE, "-k", OFFLOAD, "--html", "html/pytest.html", "--self-contained-html")
    result.assert_outcomes(passed=1, skipped=1)
    text = (pytester.path / "html" / "pytest.html").read_text(encoding="utf-8")
    blob = json.loads(html.unescape(re.search(r'data-jsonblob="([^"]*)"', text).group(1)))
    extras = {test_id: [e for entry in entries for e in entry["extras"]]
              for test_id, entries in blob["tests"].items()}
    offloaded = next(found for test_id, found in extras.items() if test_id.endswith(f"[{OFFLOAD}]"))
    assert [e["name"] for e in offloaded] == ["llmload: device map", "llmload: memory per phase"]
    for extra in offloaded:
        assert extra["format_type"] == "image" and extra["mime_type"] == "image/png"
        assert base64.b64decode(extra["content"].removeprefix("data:image/png;base64,")).startswith(b"\x89PNG")
    assert not any(found for test_id, found in extras.items() if test_id.endswith("_cuda]"))
    assert not (pytester.path / "report.html").exists()  # no --llmload-html: pytest-html's report only


@pytest.mark.timeout(60)
def test_without_matplotlib_the_option_is_one_usage_error_naming_the_extra(pytester):
    pytester.makeconftest("import sys\nsys.modules['matplotlib'] = None  # as if not installed\n")
    pytester.makepyfile("def test_plain(): pass\n")
    # Its own process, forked from this one (fixtures/warm_runs.py): the conftest blocks matplotlib there first.
    result = warm_runs.runpytest(pytester, "-p", "no:cacheprovider", "--llmload-html", "report.html")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --llmload-html draws its figures with matplotlib, which is not installed: "
                                 "pip install 'pytest-llmload[report]'"])
    assert not (pytester.path / "report.html").exists()


PROBE = """
import sys

def pytest_unconfigure(config):
    print("MATPLOTLIB IMPORTED:", "matplotlib" in sys.modules)
    print("REPORT REGISTERED:", config.pluginmanager.has_plugin("llmload-html-report"))
"""


@pytest.mark.timeout(120)
def test_a_run_without_the_report_draws_nothing_and_imports_no_matplotlib(pytester):
    pytester.makeconftest(PROBE)
    pytester.makepyfile("def test_ckpt(llmload_load): llmload_load()\n")
    # A new interpreter: what the run imports is the subject (a forked one starts with this process's modules).
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["MATPLOTLIB IMPORTED: False", "REPORT REGISTERED: False"])


@pytest.mark.parametrize(("names", "written"), [
    (["model.embed_tokens", "model.layers.0"], "model.embed_tokens, model.layers.0"),
    (["model.layers.1", "model.layers.2", "model.layers.3", "model.norm", "lm_head"],
     "model.layers.1\u20133, model.norm, lm_head"),
    (["model.layers.0", "model.layers.2", "model.layers.3"], "model.layers.0, model.layers.2\u20133"),
    (["<whole model>"], "<whole model>"),
])
def test_numbered_modules_are_written_as_ranges(names, written):
    assert compress_modules(names) == written


PREDICTION_GROUP = re.compile(r'<div class="prediction" data-check="([^"]+)" data-runner="([^"]*)" '
                              r'data-failure="([^"]*)">(.*?)</div></div></div>')
DEVICE_BAR = re.compile(r'<div class="device(?: over)?" data-device="([^"]+)" data-capacity="(\d*)" '
                        r'data-weights="(\d*)" data-peak="(\d*)" data-modules="(\d+)">'
                        r'.*?<span class="holds">([^<]*)</span>')


@pytest.mark.timeout(240)
def test_a_prediction_run_draws_a_bar_group_per_prediction_with_its_devices_and_capacities(pytester):
    """Before (issue 38): the report drew only three after-loading rows, titled 'loaded in 0.57 s', with the CI
    process's own memory and no capacity. Now each prediction gets a bar per device of the runner, filled against the
    device's capacity, the modules it holds on it, the predicted failure beside it; no picture of this process."""
    warm_runs.runpytest(
        pytester, *SUITE, "--llmload-runner", "2xH100-80GB,1x24GB-RTX4090", "--llmload-model", "llama-3-8b",
        "--llmload-loader", "fixtures.loaders.before_move_offloaded:load", "-k",
        "predict_inference_load or predict_launcher_ddp or predict_zero3 or predict_moved", "--llmload-html",
        "report.html", "--llmload-progress", "progress.jsonl")
    progress = [r["row"] for r in map(json.loads, (pytester.path / "progress.jsonl").read_text().splitlines())
                if r.get("event") == "result"]
    drawn = {r["check"]: r for r in progress if r.get("prediction")}
    assert len(drawn) >= 5 and any(r["outcome"] == "predicted" for r in drawn.values()), progress
    text = (pytester.path / "report.html").read_text(encoding="utf-8")
    _assert_self_contained(text)
    groups = {check: (runner, failure, body) for check, runner, failure, body in PREDICTION_GROUP.findall(text)}
    predicted = {r["check"] for r in progress if r["outcome"] == "predicted"}
    assert set(groups) == set(drawn) | predicted  # one group per prediction (a refused placement: no map to draw)
    for check, record in drawn.items():
        runner, failure, body = groups[check]
        prediction = record["prediction"]
        assert (runner, failure) == (prediction["runner"], record["failure"] or "")
        bars = DEVICE_BAR.findall(body)
        assert [(device, int(capacity)) for device, capacity, *_ in bars] == [
            (d["device"], d["capacity"]) for d in prediction["devices"]], check
        assert [html.unescape(holds) for *_, holds in bars] == [prediction["placement"][d["device"]]
                                                                 for d in prediction["devices"]]
        verdict = html.unescape(body[body.index('class="pred-verdict"'):])
        assert (f"would hit {record['failure']}" if record["failure"] else "no failure predicted") in verdict
    assert "<figure" not in text  # the stand-ins' loads are this process's: not drawn
    assert _rows(text).keys() >= drawn.keys() and 'href="#t-' in text


MiB = 1 << 20
WHOLE_ON_CPU = {"kind": "LlamaForCausalLM", "source": "/tmp/llama", "seconds": 0.2, "load": "llama for train on cpu",
                "map_source": "hf_device_map at load", "unmatched_bytes": 0,
                "devices": [{"device": "cpu", "modules": ["<whole model>"], "bytes": 755968}]}


def _report_row(name: str, outcome: str, loads: list[float], rss: int) -> dict:
    """A row as the report collects it: a test that loaded the tiny model whole on cpu, once per entry of ``loads``
    (its seconds), in a process of ``rss`` bytes that grew by 3 MiB."""
    phases = [{"name": "load", "label": "load (llama)", "depth": 0, "rss_before": rss, "rss_peak": rss + 3 * MiB}]
    row = Row(check=name, verdict=outcome, sentence="assert 1 == 2" if outcome == "failed" else "", seconds=0.5)
    return {"nodeid": f"test_x.py::{name}", "row": row, "known": "",
            "record": {"models": [dict(WHOLE_ON_CPU, seconds=s) for s in loads], "phases": phases}}


def test_the_failing_row_comes_first_and_each_picture_is_drawn_once(pytestconfig):
    rows = [_report_row("test_a", "passed", [0.2, 0.3], 300 * MiB), _report_row("test_b", "failed", [0.5], 310 * MiB),
            _report_row("test_c", "passed", [0.4], 300 * MiB)]
    text = render_html(pytestconfig, rows, 0.0, 1.0)
    _assert_self_contained(text)
    assert _rows(text) == {"test_a": "passed", "test_b": "failed", "test_c": "passed"}
    card = text[text.index('<section class="card failed"'):text.index("<details")]
    assert 'data-check="test_b"' in card and "assert 1 == 2" in card  # the failure first, with its finding
    # Its pictures where it is, the first time: the device map (the same placement for every load), its memory.
    assert len(PNG_URI.findall(card)) == 2 and SAME_PICTURE not in card
    a, c = _pictures_of(text, "test_a"), _pictures_of(text, "test_c")
    assert a.count(SAME_PICTURE) == 1 and len(PNG_URI.findall(a)) == 1  # its two loads, one picture: the card's
    assert a.count("<li>") == 2 and "in 0.20 s" in a and "in 0.30 s" in a
    assert c.count(SAME_PICTURE) == 2 and not PNG_URI.findall(c)  # memory as test_a's, device map as test_b's
    assert "test_a's</a>" in c and "test_b's</a>" in c


@pytest.mark.parametrize(("values", "start"), [
    ([330 * MiB, 391 * MiB], 310 * MiB),  # a rise of 61 MiB on 330: the axis starts under the lowest, at 310 MiB
    ([800 * MiB, 803 * MiB], 790 * MiB),  # 3 MiB on 800 is seen
    ([372 * MiB, 372 * MiB], 369 * MiB),  # no change: the bars still end apart from the axis
    ([100 * MiB, 400 * MiB], 0),  # a span from near 0: the axis starts at 0
    ([0, 5 * MiB], 0),  # a GPU's allocation from nothing
])
def test_a_memory_axis_starts_near_the_lowest_value_it_shows(values, start):
    assert axis_start(values) == start


def test_a_checks_pictures_come_from_its_row(pytestconfig, tmp_path):
    """The report takes a check's row as it is, what it saw included (``Row.artefacts``: its isolated children's come
    back with their answers): no record of its own beside the row (before issue 47, a spool of the report's own, then
    a record on the teardown report)."""
    from types import SimpleNamespace

    from pytest_llmload.reports.html_data import record_from
    from pytest_llmload.reports.html_report import HtmlReport

    artefacts = {"models": [{"kind": "LlamaForCausalLM", "source": "/nowhere/llama", "seconds": 0.2, "where": "cpu",
                             "device_map": None}],
                 "phases": [{"name": "load", "label": "load (llama)", "depth": 0, "rss_before": 300 * MiB,
                             "rss_peak": 303 * MiB, "running": False, "seconds": 0.2, "started": 1.0,
                             "detail": "llama for train on cpu"}]}
    row = Row(check="own_thing", verdict="passed", guards="use-cache-off", seconds=0.3, artefacts=artefacts)
    # (a config of its own: this test's may be an xdist worker's, where the report collects nothing)
    report = HtmlReport(SimpleNamespace(), tmp_path / "report.html", extras=False, missing_matplotlib=False)
    nodeid = "test_gate.py::test_loader_check[own_thing]"
    for when in ("setup", "call", "teardown"):
        report.pytest_runtest_logreport(SimpleNamespace(
            nodeid=nodeid, when=when, outcome="passed", duration=0.1, sections=[],
            user_properties=row.properties() if when == "call" else []))
    (entry,) = report.rows.values()  # (what render_html draws: the same record, no picture drawn here)
    assert entry["row"] == row and entry["record"] == record_from(artefacts), entry

"""``python -m pytest_llmload``: one row per check, pytest's exit codes (0 / 1 / 2 / 4 / 5), progress while it runs,
lines that fit the terminal."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from fixtures import warm_runs
from pytest_llmload.reports.row import Row

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _temp_dirs_in_tmp_path(tmp_path, monkeypatch):
    # A main job keeps its temp dir when a check failed (by design); these tests fail checks on purpose.
    (tmp_path / "tmpdir").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmpdir"))
    # What the main job says, each sentence on one line: the tests of lines that fit a terminal set their own width.
    monkeypatch.setenv("COLUMNS", "1000")


def main_job(*args, cwd=REPO, env=None):
    """The real command: for the tests whose subject is the process (exit codes end to end, signals, the process
    tree, temp dirs left behind, pytest dying, a hang's deadline)."""
    return subprocess.run([sys.executable, "-m", "pytest_llmload", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=280, env=env)


# The main job in this process, its pytest forked from it (fixtures/warm_runs.py): the same command line without
# a new interpreter's ~8 s of imports, for the tests whose subject is what the main job prints or decides.
warm_main_job = warm_runs.main_job


new_tmpdir, left_in = warm_runs.new_tmpdir, warm_runs.left_in


# (Each real main job imports the stack, ~8 s: a run serves every assertion about it.)
def test_reference_loader_passes_with_a_row_per_check_and_leaves_nothing_behind(tmp_path):
    """The real command end to end: exit 0, the default loader as a new interpreter finds it, no temp dir left."""
    env = {**new_tmpdir(tmp_path), "COLUMNS": "120"}  # (a CI log's width)
    run = main_job("-k", "pad_token or offload_inference", env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "llmload: checking loader pytest_llmload.fixes.reference_loader:load_model_and_tokenizer (from built-in default)" in out
    assert "llmload: 3 checks collected" in out
    assert re.search(r"^\[1/3\] check_", out, re.M)  # progress rows as results arrive
    assert max(map(len, out.splitlines())) <= 120, out
    table = out[out.index("check  "):]
    rows = (r"check_offload_inference +offload-hang \(000\) +passed +\d+\.\d\ds",
            r"check_pad_token_set_offline +offload-hang \(000\) +passed",
            # (its reason in its cell, or below its row where the cell would make the line too wide)
            r"check_offload_inference_cuda +offload-hang \(000\) +skipped"
            r"(?: \(| +\d+\.\d\ds\n    )needs 1 GPU, 0 visible")
    # the table in collection order
    assert re.search("".join(f"^{row}.*\n" for row in rows), table, re.M), table
    assert "llmload: 2 passed, 1 skipped in" in out
    assert "nothing failed: pytest output removed (--log PATH keeps it)" in out
    assert left_in(env) == []


def test_a_before_loader_fails_with_exit_1_naming_the_check():
    run = warm_main_job("--loader", "fixtures.loaders.before_meta_backward:load", "-k",
                        "train_request_trains and not cuda")
    assert run.returncode == 1, run.stdout + run.stderr
    assert re.search(r"^check_train_request_trains +meta-backward \(002\) +FAILED", run.stdout, re.M), run.stdout
    # The finding in the check's own words, with the lines that say what failed, then what to do about it.
    assert "FAILED check_train_request_trains: 4 of 8 train requests failed (write-up 002" in run.stdout, run.stdout
    assert re.search(r"^ +\[max_memory=.*lora=False, gradient_checkpointing=False\]$", run.stdout, re.M), run.stdout
    assert "    fix (meta-backward): " in run.stdout, run.stdout


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nope_missing_pkg:load", "llmload: ERROR: loader spec 'nope_missing_pkg:load' from --loader: module "
                                  "'nope_missing_pkg' does not import"),
        ("not a spec", "llmload: error: loader spec 'not a spec' from --loader is not of the form 'module:function'"),
    ],
)
def test_a_bad_loader_is_a_usage_error_exit_4(spec, message):
    """pytest's exit code for a usage error (its 2 means interrupted)."""
    run = main_job("--loader", spec)  # the real command: exit 4 end to end (no pytest starts: no stack imported)
    assert run.returncode == 4, run.stdout + run.stderr
    assert message in run.stderr, run.stderr


def test_list_names_every_check_and_its_failure():
    run = warm_main_job("--list")
    assert run.returncode == 0
    for line in ("check_train_request_trains", "meta-backward", "check_distributed_train_step",
                 "distributed-device-map", "check_trainer_does_not_wrap_placed_model", "dp-dtype"):
        assert line in run.stdout


# A loader whose module writes its process's pid each time it is imported, and each process that calls it.
COUNTING_LOADER = '''
import os

with open(os.environ["LLMLOAD_TEST_IMPORTS"], "a") as imports:
    imports.write(f"{os.getpid()}\\n")


def load(request):
    from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer

    with open(os.environ["LLMLOAD_TEST_CALLS"], "a") as calls:
        calls.write(f"{os.getpid()}\\n")
    return load_model_and_tokenizer(request)
'''
# The real command, its parent process watched: what it had imported when it ended, and its pid.
WATCHED_PARENT = (
    "import atexit, json, os, runpy, sys\n"
    "atexit.register(lambda: open(os.environ['LLMLOAD_TEST_PARENT'], 'w').write(json.dumps("
    "{'pid': os.getpid(), 'modules': sorted(sys.modules)})))\n"
    "runpy.run_module('pytest_llmload', run_name='__main__', alter_sys=True)\n")
CHECK_MODULES = tuple(f"pytest_llmload.{layer}" for layer in ("failures", "checks", "prediction", "plugin"))


def test_the_parent_imports_no_check_and_the_loader_is_imported_once_in_the_pytest_process(tmp_path):
    """The parent learns every row, and what each guards against, from its pytest's progress file: it imports no
    check (nor the plugin, nor torch). The loader is chosen and imported once, in the pytest process, which runs the
    checks: the isolated checks' children, forked from it, call it without importing it again."""
    (tmp_path / "counting_loader.py").write_text(COUNTING_LOADER)
    env = {**new_tmpdir(tmp_path), "PYTHONPATH": str(tmp_path), "LLMLOAD_TEST_IMPORTS": str(tmp_path / "imports"),
           "LLMLOAD_TEST_CALLS": str(tmp_path / "calls"), "LLMLOAD_TEST_PARENT": str(tmp_path / "parent.json")}
    run = subprocess.run([sys.executable, "-c", WATCHED_PARENT, "--loader", "counting_loader:load",
                          "-k", "(pad_token or offload_inference) and not cuda"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"^check_offload_inference +offload-hang \(000\) +passed", run.stdout, re.M), run.stdout
    parent = json.loads((tmp_path / "parent.json").read_text())
    imported = parent["modules"]
    assert [m for m in imported if m in CHECK_MODULES or m.startswith(tuple(f"{c}." for c in CHECK_MODULES))] == []
    assert not {"torch", "transformers", "counting_loader"} & set(imported)
    (importer,) = (tmp_path / "imports").read_text().split()  # once, in one process: not the parent
    assert int(importer) != parent["pid"]
    assert set((tmp_path / "calls").read_text().split()) - {importer}, "only the importer called it: no child ran"


LOADERS = '''
from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer


def breaks_on_train(request):
    """A loader's own bug (a keyword its helper does not take): an error, not a known failure."""
    if request.purpose == "train":
        raise TypeError("load_model() got an unexpected keyword argument 'load_in_4bit'")
    return load_model_and_tokenizer(request)


def never_offloads(request):
    """Ignores the budget: loads whole, so an offloading check exercises nothing."""
    return load_model_and_tokenizer(request.replace(max_memory=None))


def for_evaluation(request):
    return load_model_and_tokenizer(request)


for_evaluation.llmload_purposes = ("inference",)


def long_winded(request):
    return load_model_and_tokenizer(request)


long_winded.llmload_not_applicable = {
    "check_offload_inference": "we never offload: " + ", ".join(["our serving stack keeps every layer on its GPU"] * 12)}


def interrupts(request):
    """A loader that raises KeyboardInterrupt (a script's own Ctrl-C handling, a blocking read interrupted)."""
    if request.max_memory is None:
        raise KeyboardInterrupt
    return load_model_and_tokenizer(request)
'''


@pytest.fixture
def odd_loaders(tmp_path):
    (tmp_path / "odd_loaders.py").write_text(LOADERS)
    return tmp_path


def test_a_loaders_own_error_is_an_error_row_not_a_known_failure_and_its_log_is_kept(odd_loaders):
    env = new_tmpdir(odd_loaders)
    run = warm_main_job("--loader", "odd_loaders:breaks_on_train", "-k", "train_request_trains and not cuda",
                   "--json", str(odd_loaders / "out.json"), cwd=odd_loaders, env=env)
    assert run.returncode == 1, run.stdout + run.stderr
    (kept,) = left_in(env)
    assert [p.name for p in kept.iterdir()] == ["pytest.log"] and f"pytest output: {kept / 'pytest.log'}" in run.stdout
    assert re.search(r"^check_train_request_trains +meta-backward \(002\) +error ", run.stdout, re.M), run.stdout
    assert "ERROR check_train_request_trains: " in run.stdout and "'load_in_4bit'" in run.stdout
    document = json.loads((odd_loaders / "out.json").read_text())
    assert document["loader"] == {"spec": "odd_loaders:breaks_on_train", "source": "--loader", "inifile": None}
    assert set(document) >= {"stack", "devices", "order", "started", "seconds", "results"}
    assert document["order"] == "collection order" and "transformers" in document["stack"]
    (record,) = document["results"]
    assert (record["check"], record["outcome"], record["failure"]) == ("check_train_request_trains", "error", None)
    assert set(record) == {"check", "outcome", "verdict", "guards", "guards_origin", "failure", "sentence", "seconds",
                           "cause", "note", "notes", "fix", "loader", "not_run", "prediction", "assumptions",
                           "artefacts"}  # (the row's fields, as it is: tests/reports/test_row.py)
    assert record["prediction"] is None  # (a check's row: only a prediction's carries a map)
    assert record["assumptions"] == []  # (the notes its verdict rests on as assumptions: none)


def test_each_prediction_row_in_json_carries_its_map_and_the_table_says_where_the_model_goes(tmp_path):
    """Before (issue 38): --json had no map and no per-device figures, and '84 entries over 3 devices' never said
    that 33 went to disk; the per-device table came only with a failure."""
    # (the move-offloaded before-loader: device_map="auto" under the budget, and under ZeRO-3 too, where its
    # refusal is predicted)
    run = warm_main_job("--loader", "fixtures.loaders.before_move_offloaded:load", "--runner", "1x24GB-RTX4090",
                        "--model", "llama-3-70b", "-k", "predict_inference_load or predict_zero3", "--json",
                        str(tmp_path / "out.json"), env={**os.environ, "COLUMNS": "200"})
    assert run.returncode == 1, run.stdout + run.stderr
    records = {r["check"]: r for r in json.loads((tmp_path / "out.json").read_text())["results"]}
    inference = records["predict_inference_load@1x24GB-RTX4090"]["prediction"]
    assert [d["device"] for d in inference["devices"]] == ["cuda:0", "cpu", "disk"]
    assert all(d["weights"] and d["capacity"] and d["peak"] >= d["weights"] for d in inference["devices"])
    assert sorted(inference["device_map"]) == sorted(
        ["model.embed_tokens", *(f"model.layers.{n}" for n in range(80)), "model.norm", "model.rotary_emb", "lm_head"])
    assert inference["placement"]["disk"].endswith("-79, model.norm, model.rotary_emb, lm_head")
    assert {tier: held["modules"] for tier, held in inference["tiers"].items()} == {
        tier: sum(d["modules"] for d in inference["devices"] if d["tier"] == tier) for tier in ("gpu", "cpu", "disk")}
    zero3 = records["predict_zero3@1x24GB-RTX4090"]
    assert zero3["outcome"] == "predicted" and zero3["prediction"]["failure"] == zero3["failure"]
    out = run.stdout
    where = out[out.index("where the model would go (every map entry: --json):"):]
    disk = inference["tiers"]["disk"]
    assert f"predict_inference_load@1x24GB-RTX4090: gpu {inference['tiers']['gpu']['modules']} modules" in where
    assert f"disk {disk['modules']} modules" in where  # what goes to disk, said
    assert re.search(r"^ +disk: +\d+ modules +[\d.]+ GiB of 1024\.0 GiB  model\.layers\.\d+-79, ", where, re.M), where
    assert "predict_zero3@1x24GB-RTX4090: " in where  # a failure's devices too


def test_a_check_that_exercised_nothing_skips_and_fail_not_exercised_fails_it(odd_loaders):
    run = warm_main_job("--loader", "odd_loaders:never_offloads", "-k", "check_offload_inference and not cuda",
                        cwd=odd_loaders)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "skipped (not exercised: check_offload_inference: the loader loaded the model whole on cpu" in run.stdout
    strict = warm_main_job("--loader", "odd_loaders:never_offloads", "-k", "check_offload_inference and not cuda",
                           "--fail-not-exercised", cwd=odd_loaders)
    assert strict.returncode == 1, strict.stdout + strict.stderr
    assert "FAILED check_offload_inference: llmload strict: a check that exercised nothing is a failure" in strict.stdout
    assert strict.stderr == "", strict.stderr


def test_strict_is_not_an_option_of_the_main_job(capsys):
    """``--strict`` read like pytest's own old ``--strict`` (issue 39); no release had it: ``--fail-not-exercised``
    is the one spelling, and ``--strict`` a usage error that starts nothing (issue 47)."""
    from pytest_llmload.main_job.cli import build_parser, run

    def popen(command, **kwargs):
        pytest.fail(f"a usage error started pytest: {command}")

    with pytest.raises(SystemExit) as exited:
        run(["--strict", "-k", "pad_token"], popen=popen)
    assert exited.value.code == 4
    assert "llmload: error: unrecognized arguments: --strict" in capsys.readouterr().err
    assert "--fail-not-exercised" in build_parser().format_help()


def test_lanes_are_gone_one_process_runs_the_checks(capsys):
    """Issue 47: lanes (``--lanes``, ``--llmload-lanes``) cost more CPU than one process and did not pay back in wall
    time on a shared 2-core machine (docs/performance.md): the pytest process runs every check, an isolated one in a
    child forked from it. ``--lanes`` is a usage error that starts nothing; the pytest command asks for no lanes."""
    from pytest_llmload.config.vocabulary import SETTING
    from pytest_llmload.main_job.cli import run
    from pytest_llmload.main_job.process import pytest_command

    def popen(command, **kwargs):
        pytest.fail(f"a usage error started pytest: {command}")

    with pytest.raises(SystemExit) as exited:
        run(["--lanes", "2", "-k", "pad_token"], popen=popen)
    assert exited.value.code == 4
    assert "llmload: error: unrecognized arguments: --lanes" in capsys.readouterr().err
    assert "lanes" not in SETTING
    assert not [arg for arg in pytest_command(None, None, Path("progress.jsonl"), []) if arg.endswith("-lanes")]


def test_a_loaders_keyboard_interrupt_is_an_interruption_with_the_rows_so_far(odd_loaders):
    """Before (issue 36): exit 2 and "pytest exited 2 before any check ran", the rows that had run lost."""
    run = warm_main_job("--loader", "odd_loaders:interrupts", "-k",
                        "(offload_inference or pad_token) and not cuda", cwd=odd_loaders)
    assert run.returncode == 2, run.stdout + run.stderr
    assert re.search(r"^check_offload_inference +offload-hang \(000\) +passed", run.stdout, re.M), run.stdout
    assert "ERROR check_pad_token_set_offline: interrupted while this check ran (a KeyboardInterrupt" in run.stdout
    assert "llmload: interrupted while check_pad_token_set_offline ran (pytest's exit 2" in run.stderr
    assert "before any check ran" not in run.stderr


def test_an_inference_only_loader_skips_the_training_checks(odd_loaders):
    run = warm_main_job("--loader", "odd_loaders:for_evaluation", "-k", "train_request_trains and not cuda",
                        cwd=odd_loaders)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "skipped (check_train_request_trains: loader odd_loaders:for_evaluation is declared for inference only" \
        in run.stdout


# --- reliability: signals, crashes, hangs (issue 17) ---------------------------------------------------------

MISBEHAVING = '''
import ctypes
import os
import signal
import time


def _called():
    with open(os.environ["LLMLOAD_TEST_CALLED"], "a") as f:
        f.write(f"{os.getpid()}\\n")


def hangs(request):
    _called()
    while True:
        time.sleep(1)


def crashes(request):
    """The first call dies by SIGSEGV, the next by os._exit(3), as a loader's native code or its script might."""
    try:
        os.close(os.open(os.environ["LLMLOAD_TEST_CALLED"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        print("Writing model shards: 100%")
        os._exit(3)
    ctypes.string_at(0)


def kills_pytest(request):
    os.kill(os.getppid(), signal.SIGKILL)  # the isolated check's parent: pytest itself
    time.sleep(60)
'''
# pytest-timeout's deadline for the call only (setup builds the checkpoint): an isolated check's own deadline ends
# before it, leaving room for the child's stacks (pytest_llmload.runners.isolation.effective_timeout: 4 s gives the
# check 1 s, its least), so a hang costs a second here. The loader hangs at once: 1 s finds it in the loader.
SHORT_DEADLINES = '''
import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.timeout(4, func_only=True), append=False)
'''


@pytest.fixture
def misbehaving(tmp_path, monkeypatch):
    (tmp_path / "misbehaving.py").write_text(MISBEHAVING)
    (tmp_path / "short_deadlines.py").write_text(SHORT_DEADLINES)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("LLMLOAD_TEST_CALLED", str(tmp_path / "called"))
    return tmp_path


def _left_behind(tmpdir: Path) -> list[str]:
    return sorted(str(p.relative_to(tmpdir)) for p in tmpdir.rglob("llmload-*"))


def _processes_with(marker: str) -> list[int]:
    """Every process whose environment carries ``marker`` (what the run's processes inherit)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def _until(condition, seconds: float):
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.05)
    return condition()


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the run's processes through /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_a_signal_to_the_main_job_ends_its_whole_tree(misbehaving, signum):
    """SIGTERM, Ctrl-C or SIGKILL while the loader hangs in an isolated check: within seconds no process of the
    run is left, and no temp dir; a catchable signal ends in one line and 128 + its number."""
    marker = f"LLMLOAD_TEST_RUN={uuid.uuid4().hex}"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1]}
    main = subprocess.Popen([sys.executable, "-m", "pytest_llmload", "--loader", "misbehaving:hangs", "-k",
                             "check_pad_token_set_offline"], cwd=misbehaving, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert _until((misbehaving / "called").exists, 120), "the loader was never called"
        tree = _processes_with(marker)
        assert len(tree) >= 3, tree  # the main job, pytest, the isolated check's child
        main.send_signal(signum)
        out, err = main.communicate(timeout=30)
        assert _until(lambda: not _processes_with(marker), 20), [
            (Path(f"/proc/{pid}/cmdline").read_bytes()[:200]) for pid in _processes_with(marker)]
        tmpdir = Path(os.environ["TMPDIR"])
        assert _until(lambda: not _left_behind(tmpdir), 5), _left_behind(tmpdir)
    finally:
        for pid in _processes_with(marker):
            os.kill(pid, signal.SIGKILL)
    if signum == signal.SIGKILL:
        return
    assert main.returncode == 128 + signum, out + err
    assert "Traceback" not in err, err
    name = "SIGINT (Ctrl-C)" if signum == signal.SIGINT else "SIGTERM"
    (line,) = err.splitlines()
    assert line.startswith(f"llmload: interrupted by {name} after ") and "pytest stopped and cleaned up" in line, err


def test_the_deadline_stops_the_run_as_an_interruption_with_the_rows_so_far_and_the_childs_stacks(misbehaving):
    """``--deadline S`` (issue 49 point 5): before, the main job had none (a CI timeout killed it, the rows lost); a
    stop at pytest's run deadline read as a KeyboardInterrupt or Ctrl-C. Now exit 2, the check it stopped in an
    interrupted row holding its child's stack, and --json saying the deadline stopped the run."""
    out = misbehaving / "out.json"
    # (the loader is called about 1.3 s into the run here: 5 s leaves a loaded runner room to reach it; the wait
    # sleeps, it costs no CPU)
    run = warm_main_job("--loader", "misbehaving:hangs", "-k", "check_pad_token_set_offline", "--deadline", "5",
                        "--json", str(out), cwd=misbehaving)
    assert run.returncode == 2, run.stdout + run.stderr
    document = json.loads(out.read_text())
    assert document["interrupted"] is True, document
    assert document["stopped"] == "the run's deadline (--deadline 5) passed while check_pad_token_set_offline ran"
    (row,) = document["results"]
    assert (row["check"], row["verdict"], row["cause"]) == ("check_pad_token_set_offline", "error", "interrupted")
    assert row["sentence"].startswith("the run's deadline (--deadline 5) passed while this check ran; its output: ")
    assert "its children's stacks when it stopped:" in row["sentence"] and 'misbehaving.py", line ' in row[
        "sentence"] and "in hangs" in row["sentence"], row["sentence"]
    assert "llmload: the run's deadline (--deadline 5) passed while check_pad_token_set_offline ran" in run.stderr


@pytest.mark.parametrize("value", ["0", "-1", "1e3", "inf", "nan", "²", ""])
def test_a_deadline_that_is_not_seconds_is_a_usage_error(value, capsys):
    from pytest_llmload.main_job.cli import run

    def popen(command, **kwargs):
        pytest.fail(f"a usage error started pytest: {command}")

    with pytest.raises(SystemExit) as exited:
        run(["--deadline", value], popen=popen)
    assert exited.value.code == 4
    assert f"llmload: error: argument --deadline: {value!r} is not a number of seconds above 0; give e.g. " \
           "--deadline 3600" in capsys.readouterr().err


def test_the_deadline_is_pytests_run_deadline_and_a_signal_is_passed_on_as_itself(monkeypatch):
    """pytest's own run deadline marks its JUnit XML and HTML report; SIGHUP reaches it as SIGHUP (its report files
    say SIGHUP, not SIGTERM)."""
    import argparse
    import io
    import types

    from pytest_llmload.main_job.process import MainJob, pytest_command

    argv = pytest_command(None, None, Path("progress"), [], deadline=2.5)
    assert argv[argv.index("--llmload-run-deadline") + 1] == "2.5"
    sent = []
    job = MainJob(argparse.Namespace(log=None, json_path=None), Path("."), io.StringIO())
    job.child = types.SimpleNamespace(pid=-1, poll=lambda: None, wait=lambda timeout=None: 0)
    monkeypatch.setattr(os, "killpg", lambda pid, signum: sent.append(signum))
    assert job.stop(signal.SIGHUP)
    assert sent == [signal.SIGHUP]


def test_a_pytest_that_missed_its_own_deadline_is_stopped_by_the_main_job(tmp_path, monkeypatch):
    """The main job's backstop: a pytest still running its grace after the deadline (stuck before its own deadline
    was set, or in a finalizer) is stopped, and the run ends as at the deadline: exit 2, --json saying so."""
    import argparse
    import io

    from pytest_llmload.main_job import process, table

    monkeypatch.setattr(process, "STOP_GRACE_S", 0.0)
    args = argparse.Namespace(log=None, json_path=str(tmp_path / "out.json"), runner=None, model=None,
                              pytest_args=[], deadline=0.1)
    job = process.MainJob(args, tmp_path, io.StringIO())
    sent = []

    class Stuck:  # a pytest that ends only when signalled
        pid = -1

        def poll(self):
            return -sent[0] if sent else None

        def wait(self, timeout=None):
            if not sent:
                raise subprocess.TimeoutExpired("pytest", timeout)
            return -sent[0]

    monkeypatch.setattr(os, "killpg", lambda pid, signum: sent.append(signum))
    job.child = Stuck()
    with pytest.raises(process.Interrupted) as stop:
        job.follow()
    assert table.report_interrupted(job, stop.value) == 2 and sent == [signal.SIGTERM]
    document = json.loads((tmp_path / "out.json").read_text())
    assert document["interrupted"] and document["stopped"].startswith("the run's deadline (--deadline 0.1) passed "
                                                                      "after "), document


def test_a_deadline_that_passed_before_any_check_says_so(tmp_path, capsys):
    """pytest stopped at the run's deadline while it collected: --json's ``stopped`` names the deadline, not a bare
    "pytest exited 2"."""
    import argparse
    import io

    from pytest_llmload.main_job import table
    from pytest_llmload.main_job.process import MainJob

    (tmp_path / "pytest.log").write_text("...")
    args = argparse.Namespace(log=None, json_path=str(tmp_path / "out.json"), runner=None, model=None,
                              pytest_args=[], keyword=None, deadline=2.0)
    job = MainJob(args, tmp_path, io.StringIO())
    job.interruption = {"event": "interrupted", "by": "deadline", "stopped": "stopped at the run deadline, 2 s "
                        "(--llmload-run-deadline)", "stacks": None}  # (its progress file's event)
    assert table.report(job, 2)[0] == 2
    document = json.loads((tmp_path / "out.json").read_text())
    assert document["interrupted"] and document["stopped"].startswith(
        "the run's deadline (--deadline 2) passed before any check ran; "), document
    assert "llmload: the run's deadline (--deadline 2) passed before any check ran" in capsys.readouterr().err


def test_a_hung_loader_costs_one_deadline_not_one_per_check(misbehaving):
    checks = "(pad_token or load_writes) and not cuda"
    # What the main job decides after a hang (the deadline is the isolated child's, killed in the forked pytest as in
    # a new one; the signal tests above take the real command's process tree).
    run = warm_main_job("--loader", "misbehaving:hangs", "-k", checks, "--", "-p", "short_deadlines",
                        cwd=misbehaving)
    assert run.returncode == 1, run.stdout + run.stderr
    out = run.stdout
    assert re.search(r"^FAILED check_load_writes_only_offload_folder: check_load_writes_only_offload_folder did not "
                     r"return: deadline of [\d.]+ s exceeded", out, re.M), out
    assert re.search(r"^check_pad_token_set_offline +offload-hang \(000\) +error \(not run: the loader hung before\) "
                     r"+0\.\d\ds", out, re.M), out
    assert re.search(r"^NOT RUN check_pad_token_set_offline: the loader under test hung in "
                     r"check_load_writes_only_offload_folder \(deadline [\d.]+ s\); skipping the wait: "
                     r"--wait-after-hang runs every check to its deadline$", out, re.M), out

    # What --wait-after-hang decides: the main job's option, read by its pytest.
    waits = warm_main_job("--loader", "misbehaving:hangs", "-k", checks, "--wait-after-hang", "--", "-p",
                          "short_deadlines", cwd=misbehaving)
    assert waits.returncode == 1, waits.stdout + waits.stderr
    assert re.search(r"^FAILED check_pad_token_set_offline: check_pad_token_set_offline did not return: deadline",
                     waits.stdout, re.M), waits.stdout


def test_a_crashing_loader_is_summed_up_by_its_cause_under_xdist_too(misbehaving):
    """The loader named by the cwd's ini key, as the run really uses it; a death's cause (a signal, an exit code),
    not the last line of its output; the progress total under xdist."""
    (misbehaving / "pytest.ini").write_text("[pytest]\nllmload_loader = misbehaving:crashes\n")
    # What the main job prints: its pytest forked from this process, xdist's workers new interpreters, which import
    # the loader from the run's own PYTHONPATH (runners.warm gives xdist the fork's sys.path, not this process's).
    run = warm_main_job("-k", "(pad_token or load_writes) and not cuda", "--", "-p", "xdist", "-n", "2",
                        cwd=misbehaving)
    assert run.returncode == 1, run.stdout + run.stderr
    out = run.stdout
    assert (f"llmload: checking loader misbehaving:crashes (from ini 'llmload_loader' in "
            f"{misbehaving / 'pytest.ini'})") in out, out
    assert re.search(r"^\[1/2\] check_", out, re.M) and re.search(r"^\[2/2\] check_", out, re.M), out
    # Neither is a known failure (issue 25): a death is an error with its cause, an exit is the loader's own doing.
    errors = sorted(line for line in out.splitlines() if line.startswith("ERROR "))
    assert len(errors) == 2 and not any(line.startswith("FAILED ") for line in out.splitlines()), out
    assert any(re.search(r": its child \(pid \d+\) died: killed by SIGSEGV \(exit code -11\)$", line)
               for line in errors), out
    assert any("tried to end its process with os._exit(3) while loading" in line for line in errors), out


def test_pytest_dying_under_the_main_job_is_a_row_and_keeps_the_log(misbehaving):
    run = main_job("--loader", "misbehaving:kills_pytest", "-k", "pad_token and not cuda", "--json",
                   str(misbehaving / "out.json"), cwd=misbehaving)
    assert run.returncode == 1, run.stdout + run.stderr
    document = json.loads((misbehaving / "out.json").read_text())  # (issue 49: why the run stopped early)
    assert document["stopped"] == "pytest itself ended (killed by SIGKILL (exit code -9)) while " \
        "check_pad_token_set_offline ran" and [row["cause"] for row in document["results"]] == [None]
    tmpdir = Path(os.environ["TMPDIR"])
    (kept,) = tmpdir.glob("llmload-main-*")
    assert [p.name for p in kept.iterdir()] == ["pytest.log"]  # the isolated check's temp dir went with the rest
    assert re.search(r"^ERROR check_pad_token_set_offline: pytest itself ended \(killed by SIGKILL \(exit code -9\)\) "
                     f"while this check ran; its output: {re.escape(str(kept / 'pytest.log'))}$",
                     run.stdout, re.M), run.stdout


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (("--log", "no/such/dir/out.log"), {},
         "llmload: error: --log 'no/such/dir/out.log': the directory 'no/such/dir' does not exist; create it or "
         "name a file in an existing directory."),
        (("--log", "."), {}, "llmload: error: --log '.' is a directory; name a file, e.g. --log llmload.out."),
        ((), {"PYTEST_LLMLOAD_LOADER": " "}, "llmload: error: $PYTEST_LLMLOAD_LOADER is set but empty; set it to"),
        # (read by the pytest child, at its configure: the parent imports no check; said as the parent's own error)
        (("--checks", "no_such_module:CHECKS"), {},
         "llmload: error: check spec 'no_such_module:CHECKS' from --checks does not import (ModuleNotFoundError"),
    ],
    ids=["log-missing-directory", "log-a-directory", "empty-loader-variable", "checks-no-module"],
)
def test_a_bad_command_line_is_a_sentence_and_exit_4(tmp_path, args, env, message):
    run = warm_main_job(*args, cwd=tmp_path, env={**os.environ, **env})
    assert (run.returncode, run.stdout) == (4, ""), run.stdout + run.stderr
    assert run.stderr.startswith(message) and len(run.stderr.splitlines()) == 1, run.stderr
    assert _left_behind(Path(os.environ["TMPDIR"])) == []


def test_a_collection_error_is_shown_whole(tmp_path, monkeypatch):
    reason = "a collection error naming its source: " + "x" * 200
    (tmp_path / "breaks_collection.py").write_text(
        f"def pytest_generate_tests(metafunc):\n    raise ValueError({reason!r})\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    run = warm_main_job("-k", "pad_token", "--json", str(tmp_path / "out.json"), "--", "-p", "breaks_collection",
                        cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"ValueError: {reason}" in run.stderr, run.stderr
    assert "llmload: pytest exited 2 before any check ran; pytest output removed" in run.stderr, run.stderr
    document = json.loads((tmp_path / "out.json").read_text())  # (issue 49: a run with no row says why too)
    assert document["results"] == [] and document["stopped"].startswith(
        "pytest exited 2 before any check ran: collection error in "), document
    assert _left_behind(Path(os.environ["TMPDIR"])) == []


def test_the_main_job_runs_under_its_own_options_not_the_repos_addopts(tmp_path):
    """A repo's addopts (and PYTEST_ADDOPTS) selecting nothing, or asking for randomised order, do not reach the
    main job's pytest: it decides what it runs under (issue 27)."""
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -k no_such_check --maxfail=1\n")
    env = {**new_tmpdir(tmp_path), "PYTEST_ADDOPTS": "-k nothing_either"}
    run = warm_main_job("-k", "pad_token and not cuda", cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"^\[1/1\] check_pad_token_set_offline +passed", run.stdout, re.M), run.stdout


def test_no_check_selected_exits_5_with_pytests_words(tmp_path):
    """pytest's "no tests ran" (exit 5), not a usage error: before (issue 39) exit 2 and "pytest exited 5 before any
    check ran"."""
    run = warm_main_job("-k", "no_such_check", "--json", str(tmp_path / "out.json"), cwd=tmp_path)
    assert run.returncode == 5, run.stdout + run.stderr
    document = json.loads((tmp_path / "out.json").read_text())  # (issue 49: a run with no row says why too)
    assert (document["results"], document["interrupted"]) == ([], False)
    assert document["stopped"].endswith("-k 'no_such_check' matched none of the checks (--list lists them)")
    assert re.search(r"^llmload: no tests ran \(pytest: \d+ deselected in [\d.]+s\): -k 'no_such_check' matched none "
                     r"of the checks \(--list lists them\)$", run.stdout, re.M), run.stdout
    assert "before any check ran" not in run.stdout + run.stderr
    assert _left_behind(Path(os.environ["TMPDIR"])) == []


# --- lines that fit the terminal (issue 39) ----------------------------------------------------------------------

@pytest.mark.parametrize("columns", [80, 120])
def test_every_line_fits_the_terminal_and_cut_reasons_are_whole_in_the_json_and_the_log(odd_loaders, columns):
    """Before (issue 39): the table padded every row to its longest skip reason (584-character lines on a CI log),
    and a long check name pushed the progress rows' results out of their column."""
    checks = "offload_inference or keeps_fp32_master_weights_cuda"  # a long skip reason, the longest check name
    run = warm_main_job("--loader", "odd_loaders:long_winded", "-k", checks, "--json", str(odd_loaders / "out.json"),
                        "--log", str(odd_loaders / "out.log"), cwd=odd_loaders,
                        env={**os.environ, "COLUMNS": str(columns)})
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert max(map(len, lines)) <= columns, "\n".join(line for line in lines if len(line) > columns)
    progress = [line for line in lines if line.startswith("[")]
    assert len(progress) == 3 and len({line.index(" skipped ") for line in progress}) == 1, progress  # one column
    table = lines[lines.index(next(line for line in lines if line.startswith("check  "))):]
    assert any(line.startswith("check_fp16_train_request_keeps_fp32_") for line in table), table  # (wrapped at 80)
    (record,) = [r for r in json.loads((odd_loaders / "out.json").read_text())["results"]
                 if r["check"] == "check_offload_inference"]
    reason = record["sentence"]
    assert "we never offload: our serving stack keeps every layer on its GPU" in reason and len(reason) > 3 * columns
    at = next(n for n, line in enumerate(table) if line.startswith("check_offload_inference "))
    assert re.match(r"check_offload_inference +offload-hang \(000\) +skipped +\d+\.\d\ds$", table[at]), table
    below = table[at + 1:at + 4]  # below its row: cut at three lines
    assert all(line.startswith("    ") for line in below) and below[2].endswith("...") and \
        not table[at + 4].startswith("    "), table
    assert "(reasons cut to fit " in run.stdout and "whole in pytest's log and in --json)" in run.stdout, run.stdout
    log = (odd_loaders / "out.log").read_text()
    assert "llmload: the table, every reason whole:" in log and f"skipped ({reason})" in log


ROWS = [  # the progress file's rows, as the parent reads them
    Row(check="check_fp16_train_request_keeps_fp32_master_weights_cuda", guards="fp16-unscale", guards_origin="field",
        verdict="skipped", sentence="needs 1 GPU, 0 visible (CUDA_VISIBLE_DEVICES unset)", seconds=0.01),
    Row(check="check_offload_inference", guards="offload-hang", guards_origin="000", verdict="not exercised",
        sentence="not exercised: " + ", ".join(["the loader loaded the model whole on cpu"] * 14), seconds=0.2),
    Row(check="check_distributed_train_step", guards="distributed-device-map", guards_origin="004", verdict="passed",
        notes=("judged in bfloat16 (the loader loads bfloat16 whatever is asked)",), seconds=1234.5),
    Row(check="predict_train_request_trains", guards="meta-backward", guards_origin="002", verdict="predicted",
        failure="meta-backward", seconds=0.5),
]


@pytest.mark.parametrize("columns", [40, 80, 120, 200])
def test_the_table_fits_any_width_and_loses_no_name(columns):
    from pytest_llmload.main_job.table import summary_table
    from pytest_llmload.main_job.process import progress_row

    lines = summary_table(ROWS, columns)
    assert max(map(len, lines)) <= columns, "\n".join(lines)
    rows = [progress_row(n, 4, row, max(len(r.check) for r in ROWS), columns) for n, row in enumerate(ROWS)]
    assert max(map(len, rows)) <= columns and len({len(row) for row in rows}) == 1, rows
    if columns < 80:  # (the narrowest width read: it fits, names broken where they must be)
        return
    guards_at, result_at = lines[0].index("guards against"), lines[0].index("result")
    names = "".join(line[:guards_at].strip() for line in lines)  # the first column, wrapped names joined back
    guards = "".join(line[guards_at:result_at].replace(" ", "") for line in lines)
    for row in ROWS:  # every name whole, wrapped or not
        assert row.check in names and f"{row.guards}({row.guards_origin})" in guards, "\n".join(lines)
    assert "1234.50s" in "".join(lines) and "PREDICTED" in "".join(lines)


@pytest.mark.parametrize("text", [
    "llmload: checking loader pytest_llmload.fixes.reference_loader:load_model_and_tokenizer (from built-in default)",
    "pytest output: /tmp/pytest-of-root/pytest-311/test_a_check_that_started_and_0/pytest.log " * 3,
    " " * 100 + "x" * 100,  # (leading spaces wider than a line, a word wider than a line)
    "check_fp16_train_request_keeps_fp32_master_weights_cuda", "",
])
@pytest.mark.parametrize("width", [40, 80])
def test_wrapping_keeps_every_character_within_the_width(text, width):
    from pytest_llmload.main_job.terminal import NAME_PARTS, wrap

    for breaks in ({}, {"breaks": NAME_PARTS}):
        lines = wrap(text, width, "    ", **breaks)
        assert all(len(line) <= width for line in lines), lines
        assert "".join(lines).replace(" ", "") == text.replace(" ", ""), lines


def test_prose_breaks_at_spaces_a_tables_names_inside_too():
    from pytest_llmload.main_job.terminal import NAME_PARTS, wrap

    said = "the log is /tmp/llmload-main-x/pytest.log"
    assert wrap(said, 40, "    ") == ["the log is", "    /tmp/llmload-main-x/pytest.log"]  # (a path stays whole)
    assert wrap(said, 40, "    ", NAME_PARTS) == ["the log is /tmp/llmload-main-x/", "    pytest.log"]
    assert wrap("keep it with --log PATH", 12, breaks=NAME_PARTS) == ["keep it with", "--log PATH"]


def test_the_table_keeps_one_line_a_row_where_that_fits():
    from pytest_llmload.main_job.table import summary_table

    whole = summary_table(ROWS)  # (the log's copy: no width)
    assert len(whole) == len(ROWS) + 2 and whole[3].endswith(f"  skipped ({ROWS[1].sentence})     0.20s"), whole
    fits = summary_table(ROWS[:1] + ROWS[2:], 200)
    assert len(fits) == 5 and "skipped (needs 1 GPU, 0 visible (CUDA_VISIBLE_DEVICES unset))" in fits[2], fits


def test_the_main_job_turns_off_the_house_plugins_unless_asked_after_the_double_dash():
    from pytest_llmload.main_job.process import pytest_command

    plain = pytest_command(None, None, Path("progress"), [])
    assert {"no:randomly", "no:pytest_cov", "no:xdist", "no:anyio", "no:html", "no:metadata"} <= set(plain)
    assert "addopts=" in plain
    asked = pytest_command(None, None, Path("progress"), ["-n", "2", "--cov=mypkg", "--html", "report.html"])
    assert not {"no:xdist", "no:pytest_cov", "no:html", "no:metadata"} & set(asked)
    assert {"no:randomly", "no:anyio"} <= set(asked)
    ours = pytest_command(None, None, Path("progress"), ["--llmload-html", "report.html"])
    assert "no:html" in ours  # the plugin's own report needs no pytest-html


def test_the_main_job_loads_no_conftest_from_the_folders_above_the_shipped_suite():
    # From a checkout (an editable install, a venv inside a repo) pytest loaded the repo's own conftest.py: this repo's
    # made the GPU-less server cold, and every gloo rank of the H200's main job imported the stack (issue 40).
    from pytest_llmload.main_job.process import pytest_command
    from pytest_llmload.main_job.process import SUITE_DIR

    argv = pytest_command(None, None, Path("progress"), [])
    assert argv[argv.index("--confcutdir") + 1] == str(SUITE_DIR)
    assert (SUITE_DIR / "test_loader_checks.py").is_file() and not (SUITE_DIR / "conftest.py").exists()


# --- the warm start the tests above use (fixtures.warm_popen) ---------------------------------------------

PROBE = '''
import json, os, signal, sys, tempfile

how = sys.argv[1]
print(json.dumps({
    "argv": sys.argv[1:], "cwd": os.getcwd(), "path": sys.path, "marker": os.environ.get("WARM_PROBE"),
    "tempdir": tempfile.gettempdir(), "own_group": os.getpgid(0) == os.getpid(), "stdin": sys.stdin.read(),
    "handlers": [str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM, signal.SIGPIPE)],
}))
print("on stderr", file=sys.stderr)
if how == "raises":
    raise ValueError("the module's own error")
if how == "interrupted":
    raise KeyboardInterrupt
sys.exit(3)
'''


@pytest.mark.parametrize("how", ["exits", "raises", "interrupted"])
def test_a_warm_start_is_what_a_new_interpreter_sees_and_never_returns_here(tmp_path, how):
    """The same ``python -m`` command, started as a new interpreter and forked from this test process (with a
    Python handler of its own for SIGTERM, as the main job has): the same view of itself, output and exit code."""
    from fixtures.warm_popen import popen_forked

    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "warm_probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": "lib", "WARM_PROBE": "1", "TMPDIR": str(tmp_path)}
    seen = {}
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        for name, popen in (("new", subprocess.Popen), ("warm", popen_forked)):
            with (tmp_path / name).open("w") as log:
                child = popen([sys.executable, "-m", "warm_probe", how], stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, env=env, cwd=tmp_path, process_group=0)
            seen[name] = child.wait(60), (tmp_path / name).read_text()
    finally:
        signal.signal(signal.SIGTERM, previous)
    # The same code, view and output; a traceback's frames differ below the module's (runpy's, warm's).
    assert {name: (code, out.splitlines()[:2], out.splitlines()[-1]) for name, (code, out) in seen.items()} == {
        name: (seen["new"][0], seen["new"][1].splitlines()[:2], seen["new"][1].splitlines()[-1]) for name in seen}, seen
    code, output = seen["warm"]
    assert code == {"exits": 3, "raises": 1, "interrupted": -signal.SIGINT}[how], output
    assert ('"marker": "1"' in output and f'"cwd": "{tmp_path}"' in output and "on stderr" in output
            and str(tmp_path / "lib") in output), output
    if how == "raises":
        assert "ValueError: the module's own error" in output, output


def test_a_warm_start_starts_its_own_forkserver_not_this_processs(tmp_path):
    """A forkserver this process runs is not the child's (a new interpreter has none): its isolated calls that need
    one start their own, and this process's goes on serving it."""
    from pytest_llmload.runners import warm_server
    from pytest_llmload.runners.isolation import run_isolated
    from fixtures.warm_popen import popen_forked

    (tmp_path / "forkserver_probe.py").write_text(
        "import os\nfrom pytest_llmload.runners.isolation import run_isolated\n"
        "if __name__ == '__main__':\n    print('parent of the call', run_isolated(os.getppid, start='forkserver'))\n")
    ours = run_isolated(os.getppid, start="forkserver", timeout=60)
    with (tmp_path / "out").open("w") as log:
        child = popen_forked([sys.executable, "-m", "forkserver_probe"], stdout=log, stderr=subprocess.STDOUT,
                             cwd=tmp_path, process_group=0)
    assert child.wait(120) == 0, (tmp_path / "out").read_text()
    theirs = int((tmp_path / "out").read_text().split("parent of the call")[1])
    assert theirs != ours and ours == warm_server.forkserver_pid() == run_isolated(os.getppid, start="forkserver")


@pytest.mark.parametrize(("option", "path", "said"), [
    ("--json", "/dev/full", "--json '/dev/full' is not a regular file"),
    ("--log", "/dev/full", "--log '/dev/full' is not a regular file"),
])
def test_an_output_path_that_would_fail_after_the_run_is_refused_before_it(option, path, said):
    """Before (issue 36): --json /dev/full ran every check, then a traceback and no JSON."""
    run = warm_main_job(option, path)  # (refused before any pytest starts)
    assert run.returncode == 4 and said in run.stderr, run.stdout + run.stderr


def test_a_json_that_cannot_be_written_after_the_run_says_so_and_keeps_the_table(odd_loaders, monkeypatch):
    from pytest_llmload.main_job import table

    out = odd_loaders / "out.json"
    real = table.open_output

    def full(path, **kwargs):
        if Path(path) == out:
            raise OSError(28, "No space left on device")
        return real(path, **kwargs)

    monkeypatch.setattr(table, "open_output", full)
    run = warm_main_job("--loader", "odd_loaders:for_evaluation", "-k", "pad_token and not cuda", "--json", str(out),
                        cwd=odd_loaders)
    assert run.returncode == 1, run.stdout + run.stderr
    assert re.search(r"^check_pad_token_set_offline +offload-hang \(000\) +passed", run.stdout, re.M), run.stdout
    assert "could not be written after the run (OSError: [Errno 28] No space left on device)" in run.stderr


def test_two_jobs_given_the_same_log_the_second_is_refused(odd_loaders):
    import fcntl

    log = odd_loaders / "shared.log"
    with log.open("a") as first:  # a job running now holds its log
        fcntl.flock(first, fcntl.LOCK_EX | fcntl.LOCK_NB)
        run = warm_main_job("--loader", "odd_loaders:for_evaluation", "-k", "pad_token and not cuda", "--log",
                            str(log), cwd=odd_loaders)
    assert run.returncode == 4, run.stdout + run.stderr
    assert "is the log of another job running now; give each job its own --log file" in run.stderr


def test_a_signal_keeps_the_rows_so_far_and_writes_them_to_json_marked_interrupted(tmp_path, capsys):
    """SIGINT, SIGTERM or SIGHUP to the main job (issue 49): before, one line and no --json, every row lost. Now the
    rows pytest wrote before it stopped, an error row for the check it stopped in, and --json with them."""
    import argparse
    import io
    import types

    from pytest_llmload.main_job.process import Interrupted, MainJob
    from pytest_llmload.main_job.table import report_interrupted
    from pytest_llmload.system import json_lines

    args = argparse.Namespace(log=None, json_path=str(tmp_path / "out.json"), runner=None, model=None, pytest_args=[])
    job = MainJob(args, tmp_path, io.StringIO())
    job.child = types.SimpleNamespace(poll=lambda: 0)  # (pytest stopped already)
    done = Row(check="check_offload_inference", verdict="passed", guards="offload-hang", guards_origin="000",
               seconds=0.5)
    progress = json_lines.open_for_appending(job.progress)
    for record in ({"event": "collected", "count": 2, "order": [done.check, "check_pad_token_set_offline"],
                    "guards": {"check_pad_token_set_offline": ["offload-hang", "000"]}},
                   {"event": "start", "nodeid": "x[a]", "check": done.check},
                   {"event": "result", "nodeid": "x[a]", "row": done.as_dict()},
                   {"event": "start", "nodeid": "x[b]", "check": "check_pad_token_set_offline"}):
        json_lines.append(progress, record)
    os.close(progress)
    assert report_interrupted(job, Interrupted(signal.SIGTERM)) == 128 + signal.SIGTERM
    document = json.loads((tmp_path / "out.json").read_text())
    assert document["interrupted"] is True and document["stopped"].startswith(
        "interrupted by SIGTERM after "), document["stopped"]
    assert "with 1 of 2 checks done" in document["stopped"]
    first, stopped_in = document["results"]
    assert Row.from_dict(first) == done
    assert (stopped_in["check"], stopped_in["verdict"], stopped_in["cause"], stopped_in["guards"]) == (
        "check_pad_token_set_offline", "error", "interrupted", "offload-hang")
    assert stopped_in["sentence"] == "interrupted by SIGTERM while this check ran"
    assert capsys.readouterr().err.startswith("llmload: interrupted by SIGTERM after ")


def test_a_check_that_started_and_has_no_result_gets_a_row_saying_so(tmp_path):
    """pytest ended normally (here: exit 1) while a check it had started had sent no result (its report lost): the
    row is there, saying so, and the run fails (issue 36)."""
    import argparse
    import io
    import time as clock

    from pytest_llmload.main_job import table
    from pytest_llmload.main_job.process import MainJob

    log = tmp_path / "pytest.log"
    log.write_text("...")
    job = MainJob(argparse.Namespace(log=None, json_path=None, runner=None, pytest_args=[]), tmp_path, io.StringIO())
    job.total, job.order = 1, ["check_pad_token_set_offline"]
    job.guards = {"check_pad_token_set_offline": ["offload-hang", "000"]}  # (the child's "collected" event)
    job.running = {"x::test_loader_check[check_pad_token_set_offline]": ("check_pad_token_set_offline",
                                                                         clock.monotonic())}
    code, kept = table.report(job, 1)
    assert (code, kept) == (1, True)
    assert "ERROR check_pad_token_set_offline: pytest ended without this check's result (exit code 1) while this " \
           "check ran" in job.out.getvalue(), job.out.getvalue()
    # What it guards against, as the child said when it collected it: the parent reads no check.
    assert re.search(r"^check_pad_token_set_offline +offload-hang \(000\) +error ", job.out.getvalue(), re.M)

"""A check judged where it ran (pytest_llmload.checks.judgement, issue 47 point 1): an isolated check's child judges
its own outcome and sends the row's judged fields back with its answer; the parent builds the row from them as they
are (reports.verdict.row_of) and judges only what a child cannot say, that it hung or died.

Before: the child sent its exception, and the parent judged it; one that did not pickle came back as its text, whose
head (``LoaderError: ...``) the parent parsed, and a repo's check whose own exception did not pickle read
``ChildError: ...``."""

import functools
import os
import threading

import pytest

from pytest_llmload.checks.base import Check, KnownFailure
from pytest_llmload.reports.verdict import row_of
from pytest_llmload.runners import children
from pytest_llmload.runners.isolation import ChildError, ChildTraceback, judged_by_child

FAILURE = KnownFailure(id="use-cache-off", title="an inference load with the KV cache switched off",
                       write_up="myrepo#12", signatures=(), root_cause="the loader copies its training set-up",
                       fix="set use_cache only for train requests", occurs="myrepo since 2.3")


def never_called(request):
    raise AssertionError("these checks load nothing")


def own_finding(loader, checkpoint, workdir):
    assert False, "the inference model has config.use_cache=False"


class HoldsALock(Exception):
    def __init__(self):
        super().__init__("cannot travel")
        self.lock = threading.Lock()


def own_unpicklable(loader, checkpoint, workdir):
    raise HoldsALock()


def raised_by(check: Check, tmp_path) -> BaseException:
    with pytest.raises(BaseException) as info:
        check(never_called, tmp_path, tmp_path)
    return info.value


def test_an_isolated_checks_child_sends_its_row_judged_there(tmp_path):
    check = Check(own_finding, FAILURE, isolated=True, timeout=60)
    raised = raised_by(check, tmp_path)
    assert isinstance(raised, AssertionError), "the test still fails as the check did"
    assert judged_by_child(raised) == {
        "check": "own_finding", "verdict": "failed", "guards": "use-cache-off", "failure": "use-cache-off",
        "cause": "mechanism", "sentence": "the inference model has config.use_cache=False",
        "fix": "set use_cache only for train requests"}
    row = row_of(check, raised=raised, loader="never_called")
    assert (row.verdict, row.failure, row.fix, row.loader) == ("failed", "use-cache-off", FAILURE.fix, "never_called")


def test_a_repo_checks_own_exception_that_does_not_pickle_is_judged_as_itself_in_its_child(tmp_path):
    raised = raised_by(Check(own_unpicklable, FAILURE, isolated=True, timeout=60), tmp_path)
    assert isinstance(raised, ChildError), "it did not travel: the parent has its text only"
    sentence = row_of(Check(own_unpicklable, FAILURE, isolated=True), raised=raised).sentence
    line = own_unpicklable.__code__.co_firstlineno + 1
    assert sentence == ("the check own_unpicklable itself broke (a bug in the repo's own check, not a verdict on the "
                        f"loader): HoldsALock: cannot travel at own_unpicklable ({__file__}:{line})"), sentence


def test_the_parent_takes_a_childs_row_as_it_is_and_adds_what_the_run_carries():
    exc = AssertionError("what the parent alone would call a finding")
    cause = ChildTraceback("in the isolated child (pid 1): ...")
    cause.row = {"check": "own_finding", "verdict": "error", "guards": "use-cache-off", "failure": None,
                 "cause": "loader", "sentence": "loader error: OSError: no config.json", "fix": None}
    exc.__cause__ = cause
    row = row_of(Check(own_finding, FAILURE, isolated=True), raised=exc, loader="mine:load", notes=("a note",),
                 seconds=1.5)
    assert (row.verdict, row.cause, row.sentence) == ("error", "loader", "loader error: OSError: no config.json")
    assert (row.loader, row.notes, row.seconds, row.guards_origin) == ("mine:load", ("a note",), 1.5, "extension")


def judge_in_child(raised):
    import os

    return {"judged in": os.getpid(), "raised": type(raised).__name__ if raised is not None else None}


def test_a_childs_answer_carries_what_its_judge_made_of_its_end():
    specs = [children.ChildSpec("returns", os.getpid, judge=judge_in_child),
             children.ChildSpec("raises", own_unpicklable, (None, None, None), judge=judge_in_child),
             children.ChildSpec("no judge", os.getpid)]
    returned, raised, plain = children.run_children(specs, 60)
    assert returned.row == {"judged in": returned.pid, "raised": None}
    assert raised.status == "raised" and raised.row == {"judged in": raised.pid, "raised": "HoldsALock"}
    assert plain.status == "ok" and plain.row is None



# --- a check's ranks judge what they raised, each where it ran --------------------------------------------------------


def unpicklable_on_rank_1():
    if os.environ["RANK"] == "1":
        raise HoldsALock()
    return os.getpid()


def finding_on_rank_0():
    if os.environ["RANK"] == "0":
        raise AssertionError("rank 0's model has config.use_cache=False")
    return os.getpid()


def own_ranks(loader, checkpoint, workdir, rank_code=unpicklable_on_rank_1):
    from pytest_llmload.runners.ranks import run_ranks

    run_ranks(rank_code, 2, init_process_group=False, timeout=60)


def test_a_repo_checks_rank_that_raises_sends_its_row_naming_its_file_and_line(tmp_path):
    """Before: the check's process judged each rank's exception; one that did not pickle never came back, and the
    row read '... (report it: <this project's issues>)'."""
    check = Check(own_ranks, FAILURE, world_size=2)
    raised = raised_by(check, tmp_path)
    ok, broke = raised.outcomes
    assert (ok.status, ok.row["verdict"], broke.status, broke.exception) == ("ok", "passed", "raised", None)
    line = unpicklable_on_rank_1.__code__.co_firstlineno + 2
    sentence = ("the check own_ranks itself broke (a bug in the repo's own check, not a verdict on the loader): "
                f"HoldsALock: cannot travel at unpicklable_on_rank_1 ({__file__}:{line})")
    assert broke.row == {"check": "own_ranks", "verdict": "error", "guards": "use-cache-off", "failure": None,
                         "cause": "check", "sentence": sentence, "fix": None}
    row = row_of(check, raised=raised)
    assert (row.verdict, row.cause, row.sentence) == ("error", "check", sentence)


def test_the_checks_process_takes_the_most_telling_ranks_row_as_the_rank_judged_it(tmp_path, monkeypatch):
    """The parent judges no rank's exception again: a judge that marks its output shows whose row it is."""
    from pytest_llmload.checks import base

    judged_in_child = base.judged_in_child

    def marked(check, raised):
        fields = judged_in_child(check, raised)
        return {**fields, "sentence": f"{fields['sentence']} (judged in pid {os.getpid()})"}

    monkeypatch.setattr(base, "judged_in_child", marked)
    check = Check(functools.partial(own_ranks, rank_code=finding_on_rank_0), FAILURE, world_size=2, label="own_ranks")
    raised = raised_by(check, tmp_path)
    rank_0 = raised.outcomes[0]
    row = row_of(check, raised=raised)
    assert (row.verdict, row.failure, row.fix) == ("failed", "use-cache-off", FAILURE.fix)
    assert row.sentence == f"rank 0's model has config.use_cache=False (judged in pid {rank_0.pid})", row.sentence


def a_phase_in_the_child():
    from pytest_llmload.instruments.phases import phase

    with phase("load", "in the child"):
        pass
    return os.getpid()


def test_what_a_childs_recorder_saw_comes_back_with_its_answer_into_the_tests_recorder():
    """Issue 47 point 2: the HTML report's pictures of an isolated child's loads and phases come with its answer
    (before: a spool file per child, written only while the report was on)."""
    from pytest_llmload.instruments.recorder import recording
    from pytest_llmload.runners.isolation import run_isolated

    with recording() as recorder:
        child = run_isolated(a_phase_in_the_child, timeout=60)
    (phase,) = recorder.artefacts()["phases"]
    assert (phase["name"], phase["detail"], phase["child"], phase["running"]) == ("load", "in the child", child, False)
    assert recorder.artefacts(recorder.mark()) == {"models": [], "phases": []}


PHASE_IN_CHILD = '''
import os
import tempfile

from pytest_llmload import Check, KnownFailure
from pytest_llmload.instruments.phases import phase

FAILURE = KnownFailure(id="own-phase", title="a phase", write_up="myrepo#1", signatures=(), root_cause="-",
                       fix="-", occurs="-")
tempfile.tempdir = os.path.abspath("tmp")  # (this run's own, where a spool would be made)
os.makedirs(tempfile.tempdir)


def own_phase(loader, checkpoint, workdir):
    with phase("load", "in the isolated child"):
        pass
    made = os.listdir(tempfile.tempdir)
    assert [name for name in made if not name.startswith("llmload-isolated-")] == []  # (its own workdir only)


CHECKS = [Check(own_phase, FAILURE, isolated=True)]
'''

HOOK = '''
import json

def pytest_llmload_check_result(item, check, result):
    with open("hook.jsonl", "a") as out:
        out.write(json.dumps(result) + "\\n")
'''


def test_the_html_report_spools_nothing_and_a_rows_artefacts_carry_what_its_isolated_child_recorded(pytester):
    """The row is what the HTML report reads (issue 47 point 2): the phases an isolated child ran come back with its
    answer into the row's artefacts, and the report writes no spool of its own (before: a folder per test, a file
    per child, while the report was on)."""
    import json

    from fixtures import warm_runs

    pytester.makepyfile(myrepo_checks=PHASE_IN_CHILD, hookplug=HOOK)
    result = warm_runs.runpytest(pytester, "--pyargs", "pytest_llmload.suite", "--llmload-checks", "myrepo_checks",
                                 "-k", "own_phase", "-p", "hookplug", "--llmload-html", "report.html",
                                 "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert (pytester.path / "report.html").is_file()
    (row,) = map(json.loads, (pytester.path / "hook.jsonl").read_text().splitlines())
    (child,) = [p for p in row["artefacts"]["phases"] if p.get("child")]
    assert (child["name"], child["detail"], row["verdict"]) == ("load", "in the isolated child", "passed")


def test_every_forking_checks_judge_travels_to_a_forkserver_child():
    """Where this process has initialised CUDA (or the ranks are GPU ranks), the child starts from the forkserver and
    its spec goes by pickle: the judge of every isolated check and every check's ranks, its GPU variant's included,
    must make the trip."""
    import functools
    import pickle

    from pytest_llmload.checks.judgement import judged_in_child
    from pytest_llmload.failures import REGISTRY

    forking = [variant for check in REGISTRY if check.forks for variant in (check, check.on_gpu())]
    assert any(check.world_size > 1 for check in forking) and any(check.isolated for check in forking)
    for check in forking:
        judge = pickle.loads(pickle.dumps(functools.partial(judged_in_child, check)))
        assert judge(None)["check"] == check.name

"""Tests in lanes: once collected, the pytest process forks, and each fork runs tests beside it.

Why (issue 28): on a 2-core runner the main job imported the stack in one process, then ran its checks one after
another, one core mostly idle. With ``--llmload-lanes 2`` (the main job's default where 2 CPUs are usable):

- the process forks once collection is done and what the collected checks' children import is imported (the
  Hugging Face modules, and peft where a check uses adapters: over half of the stack's import), so that the lanes
  share it: imported after the fork, every lane imported it again (the main job: 15.1 s of CPU against 11.6 s, the
  same wall time; bench_main_job.py --against);
- this process (lane 0) takes first the isolated checks that use peft, while the other lanes start at once on the
  rest, those that start ranks first (a check's ranks keep both cores busy: one lane runs them one after another);
  a lane with none of its own left takes the others' from the end. A lane reserves its next test before running one
  (pytest tears down between two tests knowing the next);
- each lane runs pytest's own protocol for its tests (fixtures, pytest-timeout, the checks' deadlines); as under
  xdist, each lane sets up its own module and session fixtures (the tiny checkpoint is built once a lane). A forked
  lane writes the main job's live rows itself (``--llmload-progress``) and hands each report to lane 0, where the
  terminal summary, JUnit XML, the HTML report and the exit status see one run; its own terminal output joins the
  log at the end where it says more than its progress letters;
- a hang of the loader seen in one lane fails the later tests of every lane at once
  (:mod:`pytest_llmload.plugin.loader_hang`): at most one deadline per lane, waited at the same time;
- a lane that dies is an error row for the test it was running, and lane 0 runs what that lane had reserved;
- under coverage a forked lane measures as an isolated child does (:mod:`.child_coverage`): its lines count.

One lane (pytest's own loop) wherever lanes would change what a run means: under xdist, with ``-x``/``--maxfail``,
``--pdb``, ``--trace``, ``--sw`` or ``--collect-only``, and for fewer than 3 tests.

Where a GPU is visible (issue 40: the H200's main job ran in one lane, 115.5 s), the tests that use it (marked
``gpu``: ``needs_gpus``, the ``_cuda`` checks, a GPU fixture) keep to lane 0, one at a time as in one lane, and the
other lanes take only the others: no two tests ever share the GPU. The memory a check measures is its own process's
(CUDA's allocator counts per process), and the checks ask for explicit per-device budgets. Where a collected check
starts gloo ranks that simulate a runner without GPUs, their GPU-less server starts before anything runs
(:func:`pytest_llmload.runners.warm_server.start_early`), so that it imports the stack while the other checks run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import pytest

from pytest_llmload.system import json_lines
from pytest_llmload.config import settings
from pytest_llmload.config.stash_keys import LANE_ATTRIBUTE

# How long lane 0 waits, after an interruption, for the other lanes to stop before killing them.
_STOP_GRACE_S = 10.0
_POLL_S = 0.05
_PROGRESS_LETTERS = ".sFEfxXp \n"


def why_one_lane(session: pytest.Session, lanes: int) -> Optional[str]:
    """Why this run keeps to pytest's own loop, or ``None`` when it runs in ``lanes`` lanes."""
    config = session.config
    if lanes < 2:
        return "one lane asked for"
    if config.option.collectonly or session.testsfailed:
        return "nothing to run, or collection errors"
    if hasattr(config, "workerinput") or getattr(config.option, "numprocesses", None):
        return "under xdist"
    if config.option.maxfail or any(getattr(config.option, name, False) for name in ("usepdb", "trace", "stepwise")):
        return "-x, --maxfail, --pdb, --trace or --sw: the run stops at a failure or a breakpoint"
    if len(session.items) < 3:
        return "fewer than 3 tests"
    return None


def _check(item: pytest.Item):
    return getattr(getattr(item, "callspec", None), "params", {}).get("check")


def _imports_peft(item: pytest.Item) -> bool:
    check = _check(item)
    return bool(getattr(check, "isolated", False) and getattr(check, "uses_peft", False))


def _ranks(item: pytest.Item) -> int:
    return int(getattr(_check(item), "world_size", 1) or 1)


def _uses_gpu(item: pytest.Item) -> bool:
    """Marked ``gpu`` (plugin.markers marks every test that needs GPUs or uses a GPU fixture), or a GPU check."""
    return item.get_closest_marker("gpu") is not None or bool(getattr(_check(item), "needs_gpus", 0))


def start_gpu_less_server_early(items) -> bool:
    """The gloo ranks' GPU-less server, started now where a GPU is visible and a collected check needs it (see the
    module's docstring); counts the GPUs (which imports torch where a driver exists) only where such a check is."""
    from pytest_llmload.runners import warm_server
    from pytest_llmload.system import gpus

    checks = [check for check in map(_check, items) if check is not None and warm_server.starts_gpu_less_ranks(check)]
    return bool(checks) and warm_server.start_early(checks, gpus.visible_gpu_count())


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session):
    lanes = settings.value(session.config, "lanes") or 1
    if not session.config.option.collectonly:
        start_gpu_less_server_early(session.items)
    if why_one_lane(session, lanes) is not None:
        return None  # pytest's own loop
    Lanes(session, lanes).run()
    if session.shouldfail:
        raise session.Failed(session.shouldfail)
    if session.shouldstop:
        raise session.Interrupted(session.shouldstop)
    return True


class Lanes:
    """One run's lanes: the tests each may take, what is taken (shared memory), and the forked lanes."""

    def __init__(self, session: pytest.Session, count: int) -> None:
        import multiprocessing

        self.session, self.config, self.count = session, session.config, count
        self.items = list(session.items)
        index = {id(item): n for n, item in enumerate(self.items)}
        heavy = [index[id(i)] for i in self.items if _imports_peft(i)]
        # The light ones that start ranks first (the longest: a lane that takes another's from the end takes short
        # ones); lane 0: its own (peft) first, then the others' from the end; the other lanes the other way round.
        light = sorted((index[id(i)] for i in self.items if not _imports_peft(i)), key=lambda n: -_ranks(self.items[n]))
        self.preference = {0: heavy + light[::-1]}
        on_gpu = {index[id(i)] for i in self.items if _uses_gpu(i)}  # lane 0's alone: one at a time on the GPU
        for lane in range(1, count):
            self.preference[lane] = [n for n in light + heavy[::-1] if n not in on_gpu]
        context = multiprocessing.get_context("fork")
        self.taken = context.RawArray("b", len(self.items))  # which lane took each test, plus one (0: nobody)
        self.lock = context.Lock()
        self.dir = Path(tempfile.mkdtemp(prefix="llmload-lanes-"))
        self.forked: dict[int, int] = {}  # lane -> pid
        self.read: dict[int, int] = {}  # lane -> bytes of its messages replayed here
        self.running: dict[int, Optional[str]] = {}  # lane -> nodeid it started and has not finished
        self.finished: set[str] = set()

    # --- choosing tests --------------------------------------------------------------------------------------
    def _take(self, lane: int) -> Optional[pytest.Item]:
        with self.lock:
            for n in self.preference[lane]:
                if not self.taken[n]:
                    self.taken[n] = lane + 1
                    return self.items[n]
        return None

    # --- the run -----------------------------------------------------------------------------------------------
    def run(self) -> None:
        self._share_temp_root()
        self._preload()
        for lane in range(1, self.count):
            self._fork(lane)
        try:
            self._run_lane(0, self._take(0))
            self._wait_for_lanes()
        except BaseException:
            self._stop_lanes()
            raise
        finally:
            self._join_output()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _share_temp_root(self) -> None:
        """pytest's temp root made before forking: one for every lane (each would make its own, later)."""
        factory = getattr(self.config, "_tmp_path_factory", None)
        if factory is not None:
            factory.getbasetemp()

    def _preload(self) -> None:
        """What the checks' children import, imported here once before forking: each lane imported it again (about
        3.5 s of CPU a lane on 2 cores, measured), and the imports are one chain in either process."""
        # (a test's "check" parameter may be a repo's own, not a Check; one that needs a GPU skips here)
        served = [check for check in map(_check, self.items)
                  if getattr(check, "forks", False) and not getattr(check, "needs_gpus", 0)]
        if served:
            from pytest_llmload.runners.preload import (
                forget_preload_failure, preload_for_isolated_checks, remember_preload_failure)

            # An import that fails here (a broken bitsandbytes raises more than ImportError; a read-only cache
            # directory) is not the run's error: each check that needs it says it, with this first cause, which a
            # second import of a half-imported module hides ("Artifact ... already registered").
            forget_preload_failure()  # (this run's preload: what an earlier run in this process saw is not its)
            try:
                preload_for_isolated_checks(peft=any(check.uses_peft for check in served))
            except Exception as exc:  # noqa: BLE001
                remember_preload_failure(exc)

    def _protocol(self, item: pytest.Item, nextitem: Optional[pytest.Item]) -> None:
        self._hang_in()
        item.ihook.pytest_runtest_protocol(item=item, nextitem=nextitem)
        self._hang_out()

    def _run_lane(self, lane: int, current: Optional[pytest.Item]) -> None:
        while current is not None:
            if self.session.shouldfail or self.session.shouldstop:
                return
            following = self._take(lane)
            self._protocol(current, following)
            if lane == 0:
                self._replay()
            current = following

    def _fork(self, lane: int) -> None:
        import gc

        from pytest_llmload.runners import child_coverage

        parent, coverage = os.getpid(), child_coverage.parent_settings()  # None unless coverage measures here
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        gc.freeze()  # (as isolation does: the fork's collections then skip this process's objects)
        pid = os.fork()
        if pid:
            gc.unfreeze()
            self.forked[lane] = pid
            return
        code, cov = 3, child_coverage.start(coverage)  # (os._exit skips coverage's own save: saved below)
        try:
            from pytest_llmload.runners import lifeline

            if not lifeline.tie_lane(parent):
                return
            self.forked = {}
            self._output_to(self.dir / f"lane{lane}.log")
            self.config.pluginmanager.register(_Sender(self.dir / f"lane{lane}.jsonl", self.config),
                                               "llmload-lane-sender")
            # pytest-reportlog writes what lane 0 replays (as JUnit XML does): here, each report would be there twice
            report_log = getattr(self.config, "_report_log_plugin", None)
            if report_log is not None:
                self.config.pluginmanager.unregister(report_log)
            self._run_lane(lane, self._take(lane))
            code = 0
        except KeyboardInterrupt:
            code = 2
        except BaseException:  # noqa: BLE001  (a lane's own crash: its log says why; lane 0 runs what is left)
            import traceback

            traceback.print_exc()
        finally:
            child_coverage.save(cov)
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)

    def _output_to(self, path: Path) -> None:
        """This lane's terminal output (progress letters, pytest-timeout's stacks) to its own file, not the log's
        middle: restart pytest's capture around the new descriptors, which it saves and restores."""
        capman = self.config.pluginmanager.getplugin("capturemanager")
        capturing = capman is not None and capman.is_globally_capturing()
        if capturing:
            capman.stop_global_capturing()
        fd = json_lines.open_for_appending(path)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        if capturing:
            capman.start_global_capturing()
            capman.suspend_global_capture()

    # --- lane 0: what the other lanes did ------------------------------------------------------------------------
    def _replay(self) -> None:
        """Each report a lane sent, through this process's hooks (its rows it wrote itself: progress skips them)."""
        for lane in self.forked:
            messages, self.read[lane] = json_lines.read_from(self.dir / f"lane{lane}.jsonl", self.read.get(lane, 0))
            for message in messages:
                if "start" in message:
                    self.running[lane] = message["start"]
                elif "finish" in message:
                    self.finished.add(message["finish"])
                    self.running[lane] = None
                elif "report" in message:
                    report = self.config.hook.pytest_report_from_serializable(config=self.config,
                                                                               data=message["report"])
                    setattr(report, LANE_ATTRIBUTE, lane)
                    self.config.hook.pytest_runtest_logreport(report=report)

    def _wait_for_lanes(self) -> None:
        while self.forked:
            self._replay()
            for lane, pid in list(self.forked.items()):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    self._replay()
                    del self.forked[lane]
                    self._after_lane(lane, os.waitstatus_to_exitcode(status))
            time.sleep(_POLL_S)
        self._run_left_over()

    def _after_lane(self, lane: int, code: int) -> None:
        """A lane that ended before finishing its tests: an error row for the one it ran."""
        nodeid = self.running.pop(lane, None)
        if nodeid is None or nodeid in self.finished:
            return
        from pytest_llmload.reports import verdict
        from pytest_llmload.runners.children import describe_exitcode

        item = next(i for i in self.items if i.nodeid == nodeid)
        how = describe_exitcode(code) if code < 0 else f"exit code {code}"
        sentence = (f"pytest's lane {lane} (a fork of the pytest process) ended ({how}) while this test ran; its "
                    f"output is in the pytest log")
        report = pytest.TestReport(
            nodeid=nodeid, location=item.location, keywords={}, outcome="failed", longrepr=sentence, when="call",
            user_properties=verdict.Verdict("error", None, "died", sentence).properties())
        self.finished.add(nodeid)
        item.ihook.pytest_runtest_logreport(report=report)

    def _run_left_over(self) -> None:
        """What a lane took and never finished (it died): run here, one after another."""
        left = [item for n, item in enumerate(self.items)
                if self.taken[n] > 1 and item.nodeid not in self.finished]
        for n, item in enumerate(left):
            self._protocol(item, left[n + 1] if n + 1 < len(left) else None)

    def _stop_lanes(self) -> None:
        for pid in self.forked.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)
        deadline = time.monotonic() + _STOP_GRACE_S
        for pid in self.forked.values():
            while time.monotonic() < deadline and not os.waitpid(pid, os.WNOHANG)[0]:
                time.sleep(_POLL_S)
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                if not os.waitpid(pid, os.WNOHANG)[0]:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
        self.forked.clear()

    def _join_output(self) -> None:
        """The other lanes' terminal output, after this one's, so that the log has all of it."""
        for log in sorted(self.dir.glob("lane*.log")):
            text = log.read_text(encoding="utf-8", errors="replace").strip()
            if text.strip(_PROGRESS_LETTERS):  # (its letters were printed here already, as its reports came)
                reporter = self.config.pluginmanager.getplugin("terminalreporter")
                if reporter is not None:
                    reporter.write_sep("-", f"llmload: output of {log.stem}")
                    reporter.write_line(text)

    # --- a hang of the loader, seen by every lane ----------------------------------------------------------------
    def _hang_in(self) -> None:
        from pytest_llmload.plugin.loader_hang import Hang, hang_key

        path = self.dir / "hang.json"
        if hang_key not in self.config.stash and path.exists():
            with contextlib.suppress(OSError, ValueError, TypeError):
                self.config.stash[hang_key] = Hang(*json.loads(path.read_text(encoding="utf-8")))

    def _hang_out(self) -> None:
        from pytest_llmload.plugin.loader_hang import hang_key

        hang = self.config.stash.get(hang_key, None)
        if hang is not None:
            with contextlib.suppress(FileExistsError), open(self.dir / "hang.json", "x", encoding="utf-8") as out:
                out.write(json.dumps(list(hang)))


class _Sender:
    """In a forked lane: each test's start, report and end, one JSON line each, for lane 0 to replay."""

    def __init__(self, path: Path, config: pytest.Config) -> None:
        self._fd = json_lines.open_for_appending(path)
        self._config = config

    def pytest_runtest_logstart(self, nodeid: str, location) -> None:
        json_lines.append(self._fd, {"start": nodeid})

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        data = self._config.hook.pytest_report_to_serializable(config=self._config, report=report)
        json_lines.append(self._fd, {"report": data}, default=str)

    def pytest_runtest_logfinish(self, nodeid: str, location) -> None:
        json_lines.append(self._fd, {"finish": nodeid})

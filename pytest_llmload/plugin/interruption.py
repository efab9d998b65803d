"""A run stopped from outside keeps its rows: SIGTERM and SIGHUP (a CI timeout, a closed terminal) stop pytest as
Ctrl-C does, and ``llmload_run_deadline`` does the same when it passes, so that pytest's session ends and writes
JUnit XML and the HTML report with the rows finished so far (pytest dies on SIGTERM without writing anything). The
run is marked interrupted: the JUnit testsuite property ``llmload_interrupted`` and the HTML report's banner say what
stopped it (:data:`~pytest_llmload.config.stash_keys.interrupted_key`); the exit code is pytest's interrupted (2).

A handler the user or another plugin set is left as it is (the main job's pytest has its own,
:func:`pytest_llmload.runners.lifeline.tie_to_main_job`, which also raises ``KeyboardInterrupt``); the previous ones
come back at unconfigure. A child forked from this process (an isolated check, a rank) dies of the signal as by
default: its parent ends it (:mod:`pytest_llmload.runners.children`); at the deadline, the parent takes the stacks of
the children still running first, and they are printed in the summary and sent with the main job's ``interrupted``
progress event (what stopped the run, and how: ``by``). Registered where the run uses the plugin
(:data:`pytest_llmload.plugin.gates.SUB_PLUGINS`); not in an xdist worker, whose controller writes the files."""

from __future__ import annotations

import os
import signal
import threading
from typing import Optional

import pytest

from pytest_llmload.config.stash_keys import interrupted_key, progress_key

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
JUNIT_PROPERTY = "llmload_interrupted"
PLUGIN_NAME = "llmload-interruption"


class Interruption:
    """The run's stop signals turned into pytest's interruption, and its deadline, installed at configure and undone
    at unconfigure."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.owner = os.getpid()
        self.saved: dict[int, object] = {}
        self.deadline: Optional[threading.Timer] = None
        self.stopping = False
        self.running: Optional[str] = None  # the test running now (its node id)
        self.by: Optional[str] = None  # what stopped the run: "deadline", a signal's name
        self.stacks: Optional[str] = None  # the stacks of the running test's children, taken at the deadline
        self.children_stacks = None  # (runners.children's switch, where a deadline is set)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():  # (signal handlers: main thread only)
            return
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) == signal.SIG_DFL:  # someone else's handler: theirs to run
                self.saved[signum] = signal.signal(signum, self._interrupt)
        from pytest_llmload.config import settings

        given = settings.given(self.config, "run_deadline")
        if given and given[0]:
            seconds, source = given
            from pytest_llmload.runners.children import stacks_at_interruption

            self.children_stacks = stacks_at_interruption  # (imported here: not from the timer's thread)
            self.deadline = threading.Timer(seconds, self._deadline_passed,
                                            args=(f"stopped at the run deadline, {seconds:g} s ({source})",))
            self.deadline.daemon = True
            self.deadline.start()

    def uninstall(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        if self.children_stacks is not None:
            self.children_stacks.clear()
        for signum, handler in self.saved.items():
            if signal.getsignal(signum) == self._interrupt:
                signal.signal(signum, handler)
        self.saved.clear()

    def _interrupt(self, signum, frame) -> None:
        if os.getpid() != self.owner:  # a child forked from this process: die as by default, its parent reports it
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.stopping:  # a second signal must not break off the reports the first one lets pytest write
            return
        self.stopping = True
        self.by = signal.Signals(signum).name
        stopped = f"stopped by {self.by}"  # (the main job's pytest says it so too: lifeline)
        self.config.stash.setdefault(interrupted_key, stopped)
        raise KeyboardInterrupt(stopped)

    def _deadline_passed(self, reason: str) -> None:
        """From the timer's thread: SIGINT to the main thread, which raises ``KeyboardInterrupt`` there even while it
        waits in a system call (a check's child), as Ctrl-C would; a check's children still running give their
        stacks before they are killed, as at their own deadline."""
        self.config.stash.setdefault(interrupted_key, reason)
        self.by = self.by or "deadline"
        self.children_stacks.set()
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self.running = nodeid

    def pytest_runtest_logfinish(self) -> None:
        self.running = None

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self) -> None:
        if self.deadline is not None:  # the reports are being written: no interruption in the middle of that
            self.deadline.cancel()

    def pytest_terminal_summary(self, terminalreporter) -> None:
        stopped = self.config.stash.get(interrupted_key, None)
        if stopped:  # (pytest's own line says only "KeyboardInterrupt" where the deadline sent it)
            terminalreporter.write_line(f"llmload: the run was interrupted: {stopped}; the report files (JUnit XML, "
                                        "the HTML report) hold the tests that finished before it.", yellow=True)
        if self.stacks:
            terminalreporter.write_line(f"llmload: the stacks of its children when it stopped:\n{self.stacks}")

    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo) -> None:
        """Before pytest's sessionfinish writes the files: what stopped the run and the test it stopped in, on the
        stash (the HTML report's banner) and as JUnit XML's testsuite property."""
        said = str(excinfo.value).strip()
        if isinstance(excinfo.value, pytest.exit.Exception):
            said = f"pytest.exit: {said}" if said else "pytest.exit"
        stopped = self.config.stash.get(interrupted_key, None) or said or (
            "stopped by a KeyboardInterrupt (Ctrl-C, or raised by the code under test)")
        if self.running:
            stopped += f" while {self.running} ran (it has no row)"
        self.config.stash[interrupted_key] = stopped
        self.stacks = getattr(excinfo.value, "llmload_stacks", None)  # (runners.children, at the deadline)
        progress = self.config.stash.get(progress_key, None)
        if progress is not None:  # the main job's rows say what stopped the run, with the stacks
            progress.write(event="interrupted", by=self.by, stopped=stopped, stacks=self.stacks)
        from _pytest.junitxml import xml_key  # (pytest's own key for its LogXML: no public handle exists)

        xml = self.config.stash.get(xml_key, None)
        if xml is not None:
            xml.add_global_property(JUNIT_PROPERTY, stopped)
            # The test that was running has a <testcase> with no name (pytest opened it for its setup's duration):
            # not a row; CI's readers would show a nameless test. A finished test's reporter has no attrs left.
            xml.node_reporters_ordered[:] = [reporter for reporter in xml.node_reporters_ordered
                                             if "name" in getattr(reporter, "attrs", {"name": None})]

def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or config.pluginmanager.has_plugin(PLUGIN_NAME):
        return
    interruption = Interruption(config)
    config.pluginmanager.register(interruption, PLUGIN_NAME)
    interruption.install()


def pytest_unconfigure(config: pytest.Config) -> None:
    interruption = config.pluginmanager.get_plugin(PLUGIN_NAME)
    if interruption is not None:
        interruption.uninstall()
        config.pluginmanager.unregister(interruption)

"""A loader that hung once costs one deadline, not one per check.

When a test that uses the ``llmload_loader`` fixture fails because a deadline passed while the loader under test
was being called (an isolated check's or a rank's child still in the loader at its deadline, a check's own
``probes.deadline``, pytest-timeout), every later test that uses the fixture fails at setup, saying so, instead
of waiting out its own deadline in the same call. ``--llmload-wait-after-hang`` runs every test to its deadline.
Under xdist each worker learns of a hang by itself: one hang per worker, at most.

Switched on by its gate in :mod:`pytest_llmload.plugin.gates` when a run uses the plugin; imports nothing heavy.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import pytest

from pytest_llmload.config import settings
from pytest_llmload.config.vocabulary import WAIT_OPTION
from pytest_llmload.system import tracebacks

# The start of the setup failure of the tests that did not wait (the main job groups them by it).
FAILED_FAST = "the loader under test hung in "


class Hang(NamedTuple):
    test: str
    deadline: Optional[float]

    def message(self) -> str:
        deadline = f" (deadline {self.deadline:.3g} s)" if self.deadline is not None else ""
        return (f"{FAILED_FAST}{self.test}{deadline}; skipping the wait: {WAIT_OPTION} runs every check to "
                "its deadline")


hang_key = pytest.StashKey[Hang]()


def _uses_loader(item: pytest.Item) -> bool:
    return "llmload_loader" in getattr(item, "fixturenames", ())


def hang_in_loader(exc: BaseException, test: str) -> Optional[Hang]:
    """The :class:`Hang`, when ``exc`` (``test``'s failure) is a deadline that passed while the loader was being
    called; ``None`` for any other failure."""
    from pytest_llmload.runners.children import children_end
    from pytest_llmload.runners.isolation import child_outcomes

    outcomes = child_outcomes(exc)
    if outcomes is not None:  # children (an isolated check, ranks): judged as the row's verdict judges them
        hung = children_end(outcomes).loader_hung
    else:  # this process: pytest-timeout's, or probes.deadline's own exception
        hung = tracebacks.is_passed_deadline(exc) and tracebacks.in_loader_call(tracebacks.exception_text(exc))
    return Hang(test, tracebacks.deadline_seconds(str(exc))) if hung else None


def fail_if_hung_before(item: pytest.Item) -> None:
    """At setup, after the skips (a check that would skip still skips), before the fixtures."""
    hang = item.config.stash.get(hang_key, None)
    if hang is not None and _uses_loader(item) and not settings.value(item.config, "wait_after_hang"):
        pytest.fail(hang.message(), pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if (report.failed and call.when == "call" and call.excinfo is not None and hang_key not in item.config.stash
            and _uses_loader(item)):
        from pytest_llmload.reports.progress import name_of

        hang = hang_in_loader(call.excinfo.value, name_of(item))
        if hang is not None:
            item.config.stash[hang_key] = hang
    return report

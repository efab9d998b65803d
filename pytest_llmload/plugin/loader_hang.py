"""A loader that hung once costs one deadline, not one per check.

When a test that uses the ``llmload_loader`` fixture fails because a deadline passed while the loader under test
was being called (an isolated check's or a rank's child still in the loader at its deadline, a check's own
``probes.deadline``, pytest-timeout), every later test that uses the fixture fails at setup, saying so, instead
of waiting out its own deadline in the same call. ``--llmload-wait-after-hang`` runs every test to its deadline.
Under xdist each worker learns of a hang by itself: one hang per worker, at most. Lanes
(:mod:`pytest_llmload.plugin.lanes`) share it: a hang in one fails the later tests of every lane.

Registered by ``plugin.switch_on`` when a run uses the plugin; imports nothing heavy.
"""

from __future__ import annotations

import re
import traceback
from typing import NamedTuple, Optional

import pytest

from pytest_llmload.config import settings
from pytest_llmload.config.vocabulary import WAIT_OPTION

# The start of the setup failure of the tests that did not wait (the main job groups them by it).
FAILED_FAST = "the loader under test hung in "

_PYTEST_TIMEOUT = re.compile(r"Timeout \(>(\d+(?:\.\d+)?)s\) from pytest-timeout")
_OWN_DEADLINE = re.compile(r"deadline (?:of )?(\d+(?:\.\d+)?) s\b")


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
    text = str(exc)
    from pytest_llmload.loader.seam import LOADER_FRAME
    from pytest_llmload.runners.isolation import child_outcomes

    outcomes = child_outcomes(exc)
    if outcomes is not None:
        # Children (an isolated check, ranks): a hang only where one was still running at its deadline and none
        # raised or died first (the others then wait on it, which is no hang of the loader's).
        statuses = [getattr(o, "status", None) for o in outcomes]
        if "hung" not in statuses or "raised" in statuses or "died" in statuses:
            return None
        where = "\n".join(o.stacks for o in outcomes if o.status == "hung")
        found = _OWN_DEADLINE.search(text)
    else:  # this process: a deadline that really passed (pytest-timeout's, or probes.deadline's own exception)
        found = _PYTEST_TIMEOUT.search(text)
        if found is None and type(exc).__name__ == "DeadlineExceeded":
            found = _OWN_DEADLINE.search(text)
        if found is None:
            return None
        where = text + "".join(traceback.format_tb(exc.__traceback__))
    if not LOADER_FRAME.search(where):
        return None
    return Hang(test, float(found.group(1)) if found else None)


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
        from pytest_llmload.reports.progress import check_name

        hang = hang_in_loader(call.excinfo.value, check_name(item.nodeid))
        if hang is not None:
            item.config.stash[hang_key] = hang
    return report

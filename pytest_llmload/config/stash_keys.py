"""What the plugin keeps on ``config.stash`` and in context for one run: the loader and hook chosen at configure,
and the options every check gets (one floor below the plugin, its fixtures and the loader seam, which all read
them). Imports pytest only."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import pytest

loader_choice_key = pytest.StashKey["LoaderChoice"]()
hook_choice_key = pytest.StashKey["LoaderChoice | None"]()  # the training-args hook configured, if any
prediction_key = pytest.StashKey[tuple]()  # (runner profiles, (model name, config)) the predictions run for
prediction_record_key = pytest.StashKey[dict]()  # a prediction test's Prediction.record(): its row carries it
checks_key = pytest.StashKey[tuple]()  # every check of the run: built-in, installed extensions, the `checks` setting
declared_key = pytest.StashKey[dict]()  # the training declarations the run set (vocabulary.TRAINING_DECLARATIONS): True

# The options the configuration gives the check a test runs (set by the plugin around the call of a test with a
# ``check`` parameter): a user's own ``parametrize_with_loader_checks`` test gets them without asking for them.
configured_check_options: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar(
    "llmload_configured_check_options", default={})

# What a check says about how it judged, for its row (set by the plugin around the call, like the options above):
# "simulated: ..." where a machine this runner lacks was stood in for.
check_notes: contextvars.ContextVar["list[str] | None"] = contextvars.ContextVar("llmload_check_notes", default=None)
notes_key = pytest.StashKey[list]()


@contextlib.contextmanager
def collecting_notes() -> Iterator[list]:
    """What checks say about their rows (:func:`add_note`) while the block runs, in the list it yields."""
    notes: list = []
    token = check_notes.set(notes)
    try:
        yield notes
    finally:
        check_notes.reset(token)


def add_note(text: str) -> None:
    """Say in the current check's row how it judged (once per text: ranks and retries say the same)."""
    notes = check_notes.get()
    if notes is not None and text not in notes:
        notes.append(text)


# On a report another lane ran and sent to lane 0 (plugin.lanes): its row was written there already.
LANE_ATTRIBUTE = "llmload_lane"

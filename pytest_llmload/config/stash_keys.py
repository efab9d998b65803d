"""What the plugin keeps on ``config.stash`` and in context for one run: its :class:`Configuration`, read once at
configure, and the notes a row collects (one floor below the plugin, its fixtures, the checks and the loader seam,
which all read them). Imports pytest only."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import types
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Optional

import pytest


@dataclasses.dataclass(frozen=True)
class Configuration:
    """The run's configuration, read once at configure into this one frozen record (``config.stash`` under
    :data:`configuration_key`): the plugin's hooks, its fixtures, the checks and the predictions take it as it is;
    none reads an option, ini key or environment variable again.

    Precedence, stated once: the option, else the environment variable (the loader's, ``$PYTEST_LLMLOAD_LOADER``),
    else the ini key, else the default; what a loader declares about itself (its purposes, dtypes, the checks that do
    not apply, how the repo trains, its training-args hook): the configuration, else the loader's own attribute.
    The loader and the hook are imported on first use, once a run (:attr:`loader_function`, :attr:`hook_function`)."""

    loader: Any = None  # the loader spec chosen and where it came from (a loader.seam.LoaderChoice)
    training_args_hook: Any = None  # the training script's hook configured (a LoaderChoice), or None
    loader_declarations: tuple[tuple[str, Any], ...] = ()  # (LoaderUnderTest field, value) the configuration declares
    trains: frozenset[str] = frozenset()  # the training declarations set (vocabulary.TRAINING_DECLARATIONS)
    strict: bool = False  # llmload_strict: a check that did not judge fails
    # Every setting, typed, and where it came from (config.settings.given reads it here): None where none sets it.
    settings: Mapping[str, Optional[tuple[Any, str]]] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({}), repr=False)
    import_spec: Optional[Callable[[Any], Callable]] = dataclasses.field(default=None, repr=False, compare=False)

    @functools.cached_property
    def loader_function(self) -> Callable:
        """The loader's callable, imported on first use (a failed import raises each time it is asked)."""
        return self.import_spec(self.loader)

    @functools.cached_property
    def hook_function(self) -> Optional[Callable]:
        """The configured training-args hook, imported on first use; ``None`` where none is configured."""
        return None if self.training_args_hook is None else self.import_spec(self.training_args_hook)

    def declares(self, keyword: str, loader: Any) -> bool:
        """Whether the repo declares training ``keyword`` for ``loader`` (a loader under test or its function): the
        configuration, else the loader function's attribute of the keyword's ini name."""
        from pytest_llmload.config.vocabulary import SETTING

        return keyword in self.trains or bool(getattr(getattr(loader, "function", loader), SETTING[keyword].ini, False))

    def check_options(self) -> dict[str, Any]:
        """What the configuration gives every check: each training declaration it sets, and ``prepare_args``, the
        configured hook (imported here, once)."""
        options: dict[str, Any] = dict.fromkeys(sorted(self.trains), True)
        hook = self.hook_function
        return options if hook is None else {**options, "prepare_args": hook}


configuration_key = pytest.StashKey[Configuration]()
prediction_key = pytest.StashKey[tuple]()  # (runner profiles, (model name, config)) the predictions run for
prediction_record_key = pytest.StashKey[dict]()  # a prediction test's Prediction.record(): its row carries it
interrupted_key = pytest.StashKey[str]()  # what stopped the run early (a signal, its deadline): the reports say it
progress_key = pytest.StashKey[Any]()  # the run's progress writer (reports.progress.ProgressWriter), where the main job asks for one
checks_key = pytest.StashKey[tuple]()  # every check of the run: built-in, installed extensions, the `checks` setting

# The configuration of the check a test runs (set by the plugin around the call of a test with a ``check``
# parameter): a user's own ``parametrize_with_loader_checks`` test honours it without asking for it.
UNCONFIGURED = Configuration()  # a run that sets none of the plugin's settings: every default
configured: contextvars.ContextVar[Configuration] = contextvars.ContextVar("llmload_configuration",
                                                                          default=UNCONFIGURED)

# The judge of the check being run (set by Check.__call__ around its run): the ranks it starts judge what they raise
# with it, as its isolated child does (a rank forked inherits it; a forkserver rank gets it pickled with its spec).
running_checks_judge: contextvars.ContextVar[Optional[Callable]] = contextvars.ContextVar(
    "llmload_running_checks_judge", default=None)

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

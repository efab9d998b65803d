"""The two records a known failure is made of: its :class:`KnownFailure` catalog entry and its :class:`Check` records.

Each module of :mod:`pytest_llmload.failures` is one known failure, named by its id (``meta-backward`` lives
in ``meta_backward.py``) and holding ``FAILURE`` (a :class:`KnownFailure`) and ``CHECKS`` (its :class:`Check`
records). When a test fails with text matching a signature, the plugin adds a section to the failure report
naming the failure, its root cause and its fix (:mod:`pytest_llmload.reports.known_failures`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

from pytest_llmload.checks.judgement import DECLARED_NOT_APPLICABLE, NOT_EXERCISED, judged_in_child
from pytest_llmload.system.words import a


# A row whose verdict rests on what the check assumed, neither observed nor declared, notes it (checks.contract.note)
# in a sentence that starts so and names the declaration that settles it. The row records those notes as its
# assumptions: the summaries under pytest's and the main job's tables list them, and `--llmload-strict` counts such
# a row as not judged.
ASSUMED = "assumed: "


def not_exercised(check: str, did_instead: str, missing: str) -> None:
    """Skip: ``check`` cannot judge this loader, which ``did_instead``, so ``missing`` was not exercised."""
    import pytest

    pytest.skip(f"{NOT_EXERCISED}{check}: the loader {did_instead}; {missing} was not exercised")


class KnownFailure(NamedTuple):
    """What a known failure is: its id and title, where it was reported, the texts it is known by, its root cause
    and fix, where it occurs. What shows it elsewhere lives there: the docs' table cells with the docs
    (``docs/hooks.py``), this repository's files for it with its tests, the runner prediction that names it with the
    prediction (``Scenario.predicts``)."""

    id: str
    title: str
    write_up: str
    signatures: tuple[str, ...]  # regular expressions searched in the failure's text
    root_cause: str
    fix: str
    occurs: str  # versions and hardware where it has been seen or reproduced
    # Extra words that must also appear in the failure text (e.g. the frame a deadline stopped in).
    context: tuple[str, ...] = ()
    # A pattern that makes the match certain (e.g. a DataParallel frame), and what its absence means.
    tell: str | None = None
    without_tell: str = ""
    # A deadline passed inside the loader call is this failure's own mechanism (offload-hang: the load never
    # returns); for every other failure a hung loader is an error row, no verdict on the failure.
    hang_is_mechanism: bool = False
    # Its place in the catalog: the registry, the main job's rows and the docs' tables list the failures in this
    # order (the write-ups first, then those from issue trackers as they were added). A new failure takes the next.
    order: int = 0
    # The fix phrased for a repo's own script (``run``'s rows): its change, no name of this plugin (a helper, a
    # declaration, an option); empty where ``fix`` already is.
    script_fix: str = ""

    @property
    def slug(self) -> str:
        """The id as a module name: ``meta-backward`` -> ``meta_backward``."""
        return self.id.replace("-", "_")

    def matches(self, text: str) -> bool:
        if not any(re.search(pattern, text) for pattern in self.signatures):
            return False
        return all(re.search(pattern, text) for pattern in self.context)

    def explain(self, text: str = "") -> str:
        lines = [
            f"[{self.id}] {self.title}",
            f"  write-up:   {self.write_up}",
            f"  root cause: {self.root_cause}",
            f"  fix:        {self.fix}",
            f"  occurs:     {self.occurs}",
        ]
        if self.tell is not None:
            seen = re.search(self.tell, text) is not None
            lines.append(f"  evidence:   {'the traceback passes through ' + self.tell if seen else self.without_tell}")
        return "\n".join(lines)


class Check(NamedTuple):
    """A conformance check: ``function(loader, checkpoint, workdir)`` raises ``AssertionError`` on a faulty loader."""

    function: Callable[[Any, Path, Path], None]
    failure: KnownFailure  # the known failure it guards against
    needs_gpus: int = 0
    world_size: int = 1  # ranks of a process group the check starts itself
    transformers: Optional[str] = None  # PEP 440 range where the failure exists; elsewhere the check skips
    timeout: float = 120.0  # seconds; a hang fails the check with every thread's stack
    label: Optional[str] = None  # the name, where ``function`` is a partial (a GPU variant, say)
    purpose: str = "inference"  # what the check asks the loader for; a loader declared for the other one skips it
    # Run in a child forked from the test process (pytest_llmload.runners.isolation): for checks that can hang, crash,
    # or change process-wide state (environment, patched upstream code, audit hooks, sockets).
    isolated: bool = False
    uses_adapters: bool = False  # works with peft adapters whatever its purpose (a train check's loader uses LoRA)
    # The extras of pytest-llmload it needs besides `hf`, which every check needs ("quant", "deepspeed"): where one
    # is not installed it skips with the pip command; the extras' table (README, --help) is made from these.
    extras: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.label or self.function.__name__

    @property
    def forks(self) -> bool:
        """Whether the check runs in children forked from its process (isolated, or ranks), which inherit what that
        process imported first (:func:`pytest_llmload.runners.preload.preload_for_isolated_checks`)."""
        return self.isolated or self.world_size > 1

    @property
    def uses_peft(self) -> bool:
        """Whether the check's process needs peft: an adapter check, or a train check (the loader may use LoRA)."""
        return self.uses_adapters or self.purpose == "train"

    @property
    def summary(self) -> str:
        doc = getattr(self.function, "__doc__", None) or getattr(getattr(self.function, "func", None), "__doc__", "")
        return " ".join(doc.strip().split("\n\n")[0].split()) if doc else ""

    def __call__(self, loader: Any, checkpoint: Path, workdir: Path, **options: Any) -> None:
        """Run the check. ``options`` go to the check function where it takes them (``prepare_args``: the
        training script's hook for the Trainer check); others are ignored, so one set fits every check."""
        import functools

        from pytest_llmload.config.stash_keys import running_checks_judge
        from pytest_llmload.loader.seam import as_loader_under_test

        args = (as_loader_under_test(loader), Path(checkpoint), Path(workdir))
        reason = self.inapplicable_reason(args[0])
        if reason is not None:
            import pytest

            pytest.skip(reason)
        kwargs = self.options_for(args[0], options)
        if self.forks:  # its children inherit these instead of each importing them
            from pytest_llmload.runners.preload import preload_for_isolated_checks

            preload_for_isolated_checks(args[1], peft=self.uses_peft)
        # Its child, or each rank it starts, judges its own outcome (the row's judged fields come back with its
        # answer): what it raised is itself there, pickled or not.
        judge = functools.partial(judged_in_child, self)
        token = running_checks_judge.set(judge)
        try:
            if not self.isolated:
                return self.function(*args, **kwargs)
            from pytest_llmload.runners import isolation

            isolation.run_isolated(self.function, args, kwargs, timeout=self.timeout, label=self.name,
                                   render=isolation.render_failure, judge=judge)
        finally:
            running_checks_judge.reset(token)

    def options_for(self, loader: Any, given: dict[str, Any]) -> dict[str, Any]:
        """The keywords the check function takes, by the one precedence: what the test passes (``given``), else the
        run's :class:`~pytest_llmload.config.stash_keys.Configuration` (the plugin's, around a test that runs a
        check), else the loader's own attributes."""
        from pytest_llmload.config.stash_keys import configured
        from pytest_llmload.config.vocabulary import TRAINING_DECLARATIONS
        from pytest_llmload.loader.seam import training_args_hook

        accepted = _keywords(self.function)
        configuration = configured.get()
        options = {**configuration.check_options(), **{k: v for k, v in given.items() if v is not None}}
        if "prepare_args" in accepted and options.get("prepare_args") is None:
            options["prepare_args"] = training_args_hook(loader)  # the loader's own, where it names one
        for keyword in TRAINING_DECLARATIONS:  # how the repo trains
            if keyword in accepted and options.get(keyword) is None:
                options[keyword] = configuration.declares(keyword, loader)
        return {k: v for k, v in options.items() if k in accepted and v is not None}

    def on_gpu(self) -> "Check":
        """The same check on ``cuda:0`` (the write-ups' own setup), named ``<name>_cuda``, needing 1 GPU."""
        return self._replace(function=OnCuda(self.function, f"{self.name}_cuda"), label=f"{self.name}_cuda",
                             needs_gpus=1)

    def inapplicable_reason(self, loader: Any) -> Optional[str]:
        """Why this check does not apply to ``loader`` (a :class:`~pytest_llmload.loader.seam.LoaderUnderTest`), decided
        in this one place before anything loads: an extra it needs is not installed, the installed transformers has
        no such failure, the loader is declared for another purpose, or the repo declared the check not applicable
        to it. ``None``: it applies. (What the loader then does, a scenario that did not happen, is the check's
        ``not exercised``.)"""
        missing = self.missing_extra_reason()
        if missing is not None:
            return missing
        version = self.version_skip_reason()
        if version is not None:
            return version
        purposes = getattr(loader, "purposes", None)
        if purposes is not None and self.purpose not in purposes:
            return (f"{self.name}: loader {loader.name} is declared for {' and '.join(purposes)} only; this check "
                    f"needs {a(self.purpose)} load")
        declared = getattr(loader, "not_applicable_reason", lambda name: None)
        reason = declared(self.name) or declared(self.name.removesuffix("_cuda"))
        if reason is not None:
            return f"{DECLARED_NOT_APPLICABLE}{self.name}: {reason} (declared for loader {loader.name})"
        return None

    def missing_extra_reason(self) -> Optional[str]:
        """Why this check cannot run here: an extra it needs is not installed (the reason names the pip command)."""
        from pytest_llmload.config.distribution import missing_extra_reason

        reasons = (missing_extra_reason(extra) for extra in self.extras)
        return next((f"{self.name}: {reason}" for reason in reasons if reason is not None), None)

    def version_skip_reason(self) -> Optional[str]:
        """Why this check does not apply to the installed transformers, or ``None`` when it does."""
        if self.transformers is None:
            return None
        from importlib import metadata

        from packaging.specifiers import SpecifierSet

        installed = metadata.version("transformers")
        if SpecifierSet(self.transformers).contains(installed, prereleases=True):
            return None
        return f"{self.name}: transformers {installed} does not have {self.failure.id}; the check applies to transformers{self.transformers}"


class OnCuda:
    """A check function called with ``device="cuda:0"``. A class of this module, not a closure: an isolated check
    run from a process that has initialised CUDA starts in a forkserver child, and its function goes there by
    pickle, which finds a function by its module and name."""

    def __init__(self, function: Callable, name: str):
        self.function = function
        self.llmload_keywords = _keywords(function)
        self.__doc__ = (function.__doc__ or "").replace(":", " on cuda:0 (the write-up's own setup):", 1)
        self.__name__ = self.__qualname__ = name
        self.__module__ = function.__module__

    def __call__(self, loader, checkpoint, workdir, **options):
        return self.function(loader, checkpoint, workdir, device="cuda:0", **options)

    def __repr__(self) -> str:
        return f"<check {self.__name__} ({self.__module__})>"


def _keywords(function: Callable) -> frozenset:
    """The keyword arguments a check function takes (a GPU variant: those of the check it wraps)."""
    import inspect

    declared = getattr(function, "llmload_keywords", None)
    if declared is not None:
        return declared
    return frozenset(name for name, p in inspect.signature(function).parameters.items()
                     if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))

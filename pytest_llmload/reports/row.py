"""One row of a check, decided once: the record every reader of a run reads.

The plugin builds a :class:`Row` for each check's test where its outcome is decided (the ``call`` phase, or the
phase that skipped or failed it), from the check's exception (:mod:`pytest_llmload.reports.verdict`, judged from
what the check raised here, in its isolated child or on its ranks), the notes the check made wherever it ran (they
come back from children with their answer), and the skip reason. It travels as data on the report
(``report.user_properties``, one JSON property, so it crosses xdist as pytest's own reports do), and the
progress file, the main job's table and ``--json``, JUnit XML, the HTML report and the
``pytest_llmload_check_result`` hook read its fields; none of them reads another's text.

A prediction's row carries where the model would go (:attr:`Row.prediction`, the record
:meth:`pytest_llmload.prediction.records.Prediction.record` makes); :mod:`pytest_llmload.placement.picture` says it in words, the same for the main job's table, pytest's terminal and
the failure's text.

Imports nothing but the size printer: the progress writer reads it, and the main job's parent reads its fields from
the progress file (what each row guards against and where that failure comes from included), never the check
registry.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional


ROW_PROPERTY = "llmload_row"
# The flat properties (report.user_properties; JUnit XML writes them as <property>): what a dashboard groups by.
VERDICT_PROPERTY, FAILURE_PROPERTY, CAUSE_PROPERTY, SENTENCE_PROPERTY = (
    "llmload_verdict", "llmload_failure", "llmload_cause", "llmload_sentence")
LOADER_PROPERTY, GUARDS_PROPERTY, NOTE_PROPERTY = "llmload_loader", "llmload_guards", "llmload_note"

# What a row says it is (the main job's table shows the same words).
VERDICTS = ("passed", "failed", "predicted", "error", "not exercised", "not applicable", "skipped", "xfailed",
            "xpassed")


# What :meth:`Row.as_dict` writes beside the fields, made from them (:meth:`Row.from_dict` leaves them).
SHOWN_BESIDE = ("note", "outcome")


@dataclasses.dataclass(frozen=True)
class Row:
    """A check's row: ``verdict`` (one of :data:`VERDICTS`), ``failure`` (the known failure observed or predicted,
    only with ``failed``/``predicted``), ``cause`` (what an ``error`` is: loader, contract, model, hang, died, check),
    ``sentence`` (the whole reason: the finding, the error, the skip reason), ``notes`` (how the check judged:
    ``judged in float16 ...``, ``simulated: ...``), ``fix`` (the code to write instead: the failure's fix, where it was
    named, or an ``error`` row's known loader fault's, :mod:`pytest_llmload.loader.faults`), ``loader`` (the
    loader that really ran), ``guards`` (the failure the check guards against) and where that failure comes from,
    ``guards_origin`` (``002``: its write-up in shared/seeds; ``field``: upstream issue trackers; ``extension``: a
    repo's own), ``not_run`` (an ``error`` that did not wait: the loader under test hung in an earlier check,
    :mod:`pytest_llmload.plugin.loader_hang`), ``assumptions`` (the notes its verdict rests on as assumptions),
    ``seconds`` (how long it took), ``artefacts`` (what the HTML report shows of it: models' placement, phases'
    memory) and ``prediction`` (a prediction's row: where the model would go,
    per device against its capacity, and the whole map; plain data, :func:`placement_lines`)."""

    check: str
    verdict: str
    guards: Optional[str] = None
    failure: Optional[str] = None
    cause: Optional[str] = None
    sentence: str = ""
    notes: tuple[str, ...] = ()
    fix: Optional[str] = None
    loader: Optional[str] = None
    guards_origin: Optional[str] = None
    not_run: bool = False
    prediction: Optional[dict] = None
    # The notes the verdict rests on as assumptions (each starts "assumed: " and names the declaration that settles
    # it, checks.base.ASSUMED): listed under the tables; --llmload-strict counts the row as not judged.
    assumptions: tuple[str, ...] = ()
    # How long the check's test took, in seconds (its call, or the phase that decided it).
    seconds: Optional[float] = None
    # What the HTML report shows of the test, as plain data: ``{"models": [...], "phases": [...]}``, its models'
    # placement and its phases' memory, from wherever the check ran (an isolated child's come back in its answer).
    artefacts: Optional[dict] = None

    @property
    def note(self) -> str:
        return "; ".join(self.notes)

    @property
    def finding(self) -> str:
        """The sentence as a line that names the check says it: an isolated check's death starts with the check's
        name (:func:`pytest_llmload.runners.isolation.run_isolated`'s label)."""
        return self.sentence.removeprefix(f"{self.check}: ")

    @property
    def outcome(self) -> str:
        """pytest's word for the row: a skip is a skip whatever its kind (``not exercised``, ``not applicable``)."""
        return "skipped" if self.verdict in ("not exercised", "not applicable") else self.verdict

    def as_dict(self) -> dict:
        """The row as plain data: its fields, and what readers show beside them (``outcome``, ``note``): the progress
        file's record, ``--json``'s row, the hook's ``result``; :meth:`from_dict` makes the row again."""
        return {**dataclasses.asdict(self), "notes": list(self.notes), "note": self.note or None,
                "outcome": self.outcome, "assumptions": list(self.assumptions)}

    @classmethod
    def from_dict(cls, fields: dict) -> "Row":
        """The row that :meth:`as_dict` gave (a field it does not have is a ``TypeError``, not a row read wrong)."""
        fields = {name: value for name, value in fields.items() if name not in SHOWN_BESIDE}
        return cls(**{**fields, "notes": tuple(fields.get("notes") or ()),
                      "assumptions": tuple(fields.get("assumptions") or ())})

    def properties(self) -> list[tuple[str, str]]:
        """``report.user_properties``: the row as one JSON property, and the flat ones a CI dashboard groups JUnit
        rows by (``llmload_verdict``, ``llmload_failure``, ``llmload_cause``, ``llmload_sentence``,
        ``llmload_loader``, ``llmload_guards``, ``llmload_note``)."""
        flat = [(LOADER_PROPERTY, self.loader or ""), (GUARDS_PROPERTY, self.guards or ""),
                (VERDICT_PROPERTY, self.verdict), (FAILURE_PROPERTY, self.failure or ""),
                (CAUSE_PROPERTY, self.cause or ""), (SENTENCE_PROPERTY, self.sentence)]
        flat += [(NOTE_PROPERTY, self.note)] if self.notes else []
        return [(ROW_PROPERTY, json.dumps(self.as_dict()))] + flat

    @classmethod
    def of_report(cls, report: Any) -> Optional["Row"]:
        """The row a report carries, ``None`` where it carries none (a test that runs no check)."""
        for key, value in reversed(list(getattr(report, "user_properties", ()) or ())):
            if key == ROW_PROPERTY:
                return cls.from_dict(json.loads(value))
        return None


def failed_lines(row: Row, ran: str, *, label: str = "", terms=str) -> list[str]:
    """How a row that did not pass is printed under a run's table (the main job's, ``run``'s, a named command's
    failure): ``FAILED <check>: <finding>`` and, where it names one the finding does not already say, ``    fix
    (<failure, else what ran>): <fix>``. ``ran``: what an error without a failure is about (``the loader``, ``the
    command``); ``label`` instead of the verdict's (``FAILED (not gated)``); ``terms`` rewrites the text for the
    reader (the main job's words for the plugin's options)."""
    label = label or {"error": "ERROR", "predicted": "PREDICTED"}.get(row.outcome, "FAILED")
    text = terms(row.finding).replace("\n", "\n    ")
    lines = [f"{label} {row.check}: {text}"]
    if row.fix is not None and row.fix not in text:
        lines.append(f"    fix ({row.failure or ran}): {terms(row.fix)}")
    return lines


def row_name(check: Any, runner: Any = None) -> str:
    """A row's name: its check's own (a repo's check need not be named ``check_*``), on a runner profile for a
    prediction (``predict_inference_load@1x24GB-RTX4090``)."""
    return check.name if runner is None else f"{check.name}@{runner.name}"


def assumption_lines(rows: list, strict_option: str, strict: bool) -> list[str]:
    """The lines under a run's table that list each row whose verdict rests on an assumption, each with the
    declaration that settles it (the assumption's own sentence names it): the same for the main job and pytest's
    terminal summary. ``rows``: ``(check, guards, assumptions)``; ``strict_option`` the option that counts such a
    row as not judged, ``strict`` whether it was given."""
    rows = [(check, guards, assumed) for check, guards, assumed in rows if assumed]
    if not rows:
        return []
    counted = f"{strict_option}: counted as not judged" if strict else f"{strict_option} counts it as not judged"
    lines = [f"llmload: {len(rows)} {'row rests' if len(rows) == 1 else 'rows rest'} on an assumption, not on "
             f"what the repo declares or its code shows ({counted}); each says what settles it:"]
    lines += [f"  {check}{f' ({guards})' if guards else ''}: {text}" for check, guards, assumed in rows
              for text in assumed]
    return lines

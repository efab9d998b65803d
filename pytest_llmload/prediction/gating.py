"""Which predictions fail the run: the runner/model pairs a repo gates on (``llmload_gate_runners``), and the
predicted rows it expects (``llmload_expected_predictions``, xfail-like, each with its reason).

A PREDICTED row on a pair the repo gates on fails the run, as before. On any other pair it is reported (the verdict
``predicted``, its figures and its map) and the run exits 0: a correct loader does not turn CI red on a runner the
team never uses. A repo that declares no pair gates on every one. An expected row is an xfail while it is predicted,
and reported like an xpass once it is not (strict, failing the run, where the repo gates on its pair)::

    [pytest]
    llmload_runner = 2xH100-80GB,8xH100-80GB
    llmload_model = llama-3-70b
    llmload_gate_runners = 8xH100-80GB:llama-3-70b
    llmload_expected_predictions =
        predict_zero3@8xH100-80GB: a full fine-tune of 70B is planned with CPU offload (issue 12)

Imports nothing heavy: the plugin reads it at configure.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Optional

ANY_MODEL = None


class GatingError(ValueError):
    """An entry that names no runner, model or scenario: the message names the value, where it came from and what
    to give instead."""


class Gating(NamedTuple):
    """``pairs``: the (runner, model) pairs the repo gates on (model ``None``: every model), none declared: every
    pair. ``expected``: the predicted rows the repo expects, ``{"scenario@runner" or "scenario": reason}``."""

    pairs: tuple[tuple[str, Optional[str]], ...] = ()
    expected: dict = {}

    def gates(self, runner: str, model: str) -> bool:
        """Whether a predicted row for ``runner`` (a profile's name) and ``model`` fails the run."""
        return not self.pairs or any(runner == gated and model_ in (ANY_MODEL, model) for gated, model_ in self.pairs)

    def expected_reason(self, scenario: str, runner: str) -> Optional[str]:
        """The reason the repo gives for expecting ``scenario`` predicted on ``runner``, ``None`` where it does not."""
        return self.expected.get(f"{scenario}@{runner}", self.expected.get(scenario))


def _runner_name(entry: str, where: str, run: tuple[str, ...]) -> str:
    """The name rows give the runner ``entry`` names (one of the ``run``'s runners or a shipped profile by name, or a
    profile file: its ``name``)."""
    from pytest_llmload.placement import profiles

    if entry in run or entry in profiles.shipped_names():
        return entry
    if entry.endswith(".json"):
        try:
            return profiles.load_profile(entry, source=where).name
        except profiles.ProfileError as exc:
            raise GatingError(str(exc)) from None
    raise GatingError(f"{where}: {entry!r} is neither a shipped runner profile ({', '.join(profiles.shipped_names())}) "
                      "nor a profile file (a path ending in .json); name the runner as --llmload-runner names it.")


def _model_name(entry: str, where: str) -> str:
    from pytest_llmload.placement import architectures

    if entry in architectures.shipped_names() or Path(entry).exists():
        return entry
    raise GatingError(f"{where}: model {entry!r} is neither a shipped architecture "
                      f"({', '.join(architectures.shipped_names())}) nor a config file; name it as --llmload-model "
                      "names it.")


def gated_pairs(entries: list[str], where: str, run: tuple[str, ...] = ()) -> tuple[tuple[str, Optional[str]], ...]:
    """``RUNNER[:MODEL]`` entries (several a line, separated by spaces or commas) as (runner name, model or
    ``None``) pairs; ``run``: the names of the run's runners."""
    pairs = []
    for entry in (word for line in entries for word in line.replace(",", " ").split()):
        runner, _, model = entry.partition(":")
        pairs.append((_runner_name(runner, where, run), _model_name(model, where) if model else ANY_MODEL))
    return tuple(pairs)


def expected_rows(expected: dict[str, str], scenarios: list[str], where: str, run: tuple[str, ...] = ()
                  ) -> dict[str, str]:
    """``{"scenario[@runner]": reason}`` checked: each names a scenario (and a runner, as rows name it)."""
    checked = {}
    for row, reason in expected.items():
        scenario, at, runner = row.partition("@")
        if scenario not in scenarios:
            raise GatingError(f"{where}: {row!r} names no prediction scenario (the scenarios: {', '.join(scenarios)}); "
                              "give 'scenario@runner: reason', as the row is named (predict_zero3@8xH100-80GB).")
        checked[f"{scenario}@{_runner_name(runner, where, run)}" if at else scenario] = reason
    return checked

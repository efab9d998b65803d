"""Every setting of :data:`pytest_llmload.config.vocabulary.SETTINGS`, registered and read in one way.

pytest-timeout's convention: each setting is an option and an ini key of the same name with one help text, parsed
into one type; the option wins over the ini key. A bad value is a usage error that names the value and where it
came from (``--llmload-near-deadline 2``, ``ini 'llmload_near_deadline'``) and what to give instead.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Callable

import pytest

from pytest_llmload.config.stash_keys import configuration_key
from pytest_llmload.config.vocabulary import SETTING, SETTINGS, Setting

GPUS_OFF = "off"


def _text(value: str, where: str, setting: Setting) -> "str | None":
    return value.strip() or None


def _bool(value: Any, where: str, setting: Setting) -> bool:
    if isinstance(value, bool):
        return value
    lowered = str(value).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise pytest.UsageError(f"{where}={value!r} is not true or false; use true or false.")


# A number as a person writes one, in ASCII digits: float() and int() also read '1e3', 'inf', '1_000', '-1' and
# other scripts' digits ('²' passes str.isdigit, then int() raises), none of which a count or seconds means.
_DECIMAL = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)", re.ASCII)
_WHOLE = re.compile(r"[0-9]+", re.ASCII)


def _number(value: str, where: str, setting: Setting, *, low: float, high: float = float("inf"), what: str) -> float:
    text = str(value).strip()
    number = float(text) if _DECIMAL.fullmatch(text) else float("nan")
    if not low <= number <= high or not math.isfinite(number):
        raise pytest.UsageError(f"{where}={value!r} is not {what}; give e.g. {setting.option} {setting.default}.")
    return number


def _positive_whole(text: str) -> "int | None":
    return int(text) if _WHOLE.fullmatch(text) and int(text) > 0 else None


def _seconds(value: str, where: str, setting: Setting) -> float:
    return _number(value, where, setting, low=0, what="a number of seconds (0 or more)")


def _fraction(value: str, where: str, setting: Setting) -> float:
    return _number(value, where, setting, low=0, high=1, what="a fraction between 0 and 1")


def _gpus(value: str, where: str, setting: Setting) -> "int | str | None":
    text = str(value).strip().lower()
    if not text:
        return None
    if text == GPUS_OFF:
        return GPUS_OFF
    count = _positive_whole(text)
    if count is not None:
        return count
    raise pytest.UsageError(
        f"{where}={value!r} is neither a positive number of GPUs nor '{GPUS_OFF}'; pass e.g. {setting.option} 2 "
        f"(each xdist worker holds 2 GPUs) or {setting.option} {GPUS_OFF}."
    )


def _count(value: str, where: str, setting: Setting) -> int:
    count = _positive_whole(str(value).strip())
    if count is not None:
        return count
    raise pytest.UsageError(f"{where}={value!r} is not a positive whole number; give e.g. {setting.option} 2.")


def _lines(value: "list[str] | str", where: str, setting: Setting) -> list[str]:
    lines = value.splitlines() if isinstance(value, str) else value
    return [line.strip() for line in lines if line.strip()]


PARSERS: dict[str, Callable[[Any, str, Setting], Any]] = {
    "text": _text, "path": _text, "bool": _bool, "lines": _lines, "seconds": _seconds, "fraction": _fraction,
    "gpus": _gpus, "count": _count,
}
_INI_TYPES = {"bool": "bool", "lines": "linelist"}  # the rest are read as strings and parsed here


def register(parser: pytest.Parser) -> None:
    """Add every setting: ``--llmload-<key>`` in the ``llmload`` group and the ini key ``llmload_<key>``."""
    group = parser.getgroup("llmload", "pytest-llmload: Hugging Face model-loading regression checks")
    for setting in SETTINGS:
        kind = setting.kind
        paired = f"{setting.help} Ini key: {setting.ini}; the option wins."
        if kind == "bool":
            group.addoption(setting.option, *setting.aliases, dest=setting.dest, action="store_true", default=None,
                            help=paired)
        elif kind == "lines":
            group.addoption(setting.option, *setting.aliases, dest=setting.dest, action="append", default=None,
                            metavar=setting.metavar, help=paired)
        else:
            group.addoption(setting.option, *setting.aliases, dest=setting.dest, default=None,
                            metavar=setting.metavar, help=paired)
        parser.addini(setting.ini, help=f"{setting.help} Option: {setting.option}, which wins.",
                      type=_INI_TYPES.get(kind, "string"), default=[] if kind == "lines" else None)


def given(config: pytest.Config, key: str) -> "tuple[Any, str] | None":
    """Setting ``key``, typed, and where it came from (the option, its environment variable, the ini key), or
    ``None`` when none sets it. An empty text reads as ``None``; a bad value is a usage error naming its source.
    Read once: a configured run's values are its :class:`~pytest_llmload.config.stash_keys.Configuration`'s."""
    configuration = config.stash.get(configuration_key, None)
    if configuration is not None and key in configuration.settings:
        return configuration.settings[key]
    setting = SETTING[key]
    option = config.getoption(setting.dest, None)
    if option is not None:
        raw, where = option, setting.option
    elif setting.env and setting.env in os.environ:
        raw, where = os.environ[setting.env], f"${setting.env}"
    else:
        try:
            raw = config.getini(setting.ini)
        except (ValueError, pytest.UsageError) as exc:  # pytest's own words name the value, not the key
            raise pytest.UsageError(f"ini '{setting.ini}': {exc}; use true or false.") from None
        if raw in (None, "", []) or (setting.kind == "bool" and raw is False):
            return None
        where = f"ini '{setting.ini}'"
    return PARSERS[setting.kind](raw, where, setting), where


def value(config: pytest.Config, key: str) -> Any:
    """Setting ``key``, typed: the option, else (where it has one) its environment variable, else the ini key, else
    its default (``None``, ``False`` or ``[]`` where it has none)."""
    found = given(config, key)
    if found is None:
        setting = SETTING[key]
        return {"bool": False, "lines": []}.get(setting.kind, setting.default)
    return found[0]


def every_setting(config: pytest.Config) -> dict[str, "tuple[Any, str] | None"]:
    """Every setting as :func:`given` reads it, at once (a bad value is a usage error now): a run that sets any is
    configured, and its configuration keeps them."""
    return {setting.key: given(config, setting.key) for setting in SETTINGS}


def any_given(config: pytest.Config) -> bool:
    """Whether the run sets any setting: the plugin is then configured."""
    return any(found is not None for found in every_setting(config).values())

"""Every setting is an option and an ini key of the same name, with one help text and one type (pytest-timeout's
convention), declared once in surface.SETTINGS: what a user sees in --help, and what each spelling reads as."""

import re

import pytest

from pytest_llmload.config.vocabulary import SETTINGS

# A valid value for each setting, as the option and the ini key take it, and the value it reads as.
SAMPLES = {
    "text": ("x", "x"), "path": ("out.file", "out.file"), "bool": (None, True), "lines": ("inference", ["inference"]),
    "seconds": ("2.5", 2.5), "fraction": ("0.5", 0.5), "gpus": ("2", 2), "count": ("2", 2),
}
SAMPLE_BY_KEY = {  # settings whose values are checked at configure
    "loader": ("os:getcwd", "os:getcwd"), "training_args_hook": ("os:getcwd", "os:getcwd"),
    "runner": ("cpu-only", "cpu-only"), "model": ("llama-3-8b", "llama-3-8b"), "progress": ("p.jsonl", "p.jsonl"),
    "expected_failed_checks": ("check_zero3_load: tracked", ["check_zero3_load: tracked"]),
    "checks": ("pytest_llmload.failures.offload_hang:CHECKS", ["pytest_llmload.failures.offload_hang:CHECKS"]),
    "gpu_fixtures": ("my_gpu", ["my_gpu"]),
    "loader_dtypes": ("bfloat16", ["bfloat16"]),
    "not_applicable": ("check_zero3_load: we train with DDP only", ["check_zero3_load: we train with DDP only"]),
    "commands": ("train: python train.py", ["train: python train.py"]),  # (collected as an item: -k test_read)
}
BAD = {"bool": "maybe", "seconds": "soon", "fraction": "2", "gpus": "two", "count": "0"}

READER = """
def test_read(request):
    from pytest_llmload.config import settings
    print("VALUE=" + repr(settings.value(request.config, {key!r})))
"""


def _sample(setting):
    return SAMPLE_BY_KEY.get(setting.key, SAMPLES[setting.kind])


def test_every_option_in_help_has_the_ini_key_of_the_same_name(pytester):
    result = pytester.runpytest("--help")
    text = result.stdout.str()
    options = set(re.findall(r"^\s+(--llmload-[a-z0-9-]+)", text, re.M))  # (digits: --llmload-trains-fp16-...)
    inis = set(re.findall(r"^\s+(llmload_[a-z0-9_]+) \(", text, re.M))
    assert options and {"llmload_" + o[len("--llmload-"):].replace("-", "_") for o in options} <= inis
    assert {s.option for s in SETTINGS} <= options


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.key)
def test_the_option_and_the_ini_key_read_as_the_same_typed_value(pytester, setting):
    raw, expected = _sample(setting)
    pytester.makepyfile(READER.format(key=setting.key))
    option = [setting.option] if setting.kind == "bool" else [setting.option, raw]
    by_option = pytester.runpytest("-s", "-p", "no:randomly", "-k", "test_read", *option)
    by_option.assert_outcomes(passed=1)
    assert f"VALUE={expected!r}\n" in by_option.stdout.str()
    pytester.makeini(f"[pytest]\n{setting.ini} = {raw if raw is not None else 'true'}\n")
    by_ini = pytester.runpytest("-s", "-p", "no:randomly", "-k", "test_read")
    by_ini.assert_outcomes(passed=1)
    assert f"VALUE={expected!r}\n" in by_ini.stdout.str()


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.kind in BAD], ids=lambda s: s.key)
def test_a_bad_typed_value_is_one_usage_error_naming_the_value_and_its_source(pytester, setting):
    pytester.makepyfile(READER.format(key=setting.key))
    pytester.makeini(f"[pytest]\n{setting.ini} = {BAD[setting.kind]}\n")
    result = pytester.runpytest("-p", "no:randomly")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*ini '{setting.ini}'*{BAD[setting.kind]}*"])
    if setting.kind != "bool":
        result = pytester.runpytest("-p", "no:randomly", "-o", f"{setting.ini}=", setting.option, BAD[setting.kind])
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines([f"*{setting.option}='{BAD[setting.kind]}'*"])


def test_the_old_spelling_of_the_phase_progress_option_still_works(pytester):
    pytester.makepyfile(READER.format(key="phase_progress_seconds"))
    result = pytester.runpytest("-s", "--llmload-phase-progress", "5")
    assert "VALUE=5.0\n" in result.stdout.str()


# What float() and int() read but no count or seconds means: a superscript digit (str.isdigit, then int() raised: an
# INTERNALERROR), an exponent, a sign, infinity, digit groups, another script's digits (issue 49, point 8).
NOT_PLAIN_NUMBERS = ["²", "1e3", "-1", "inf", "1_0", "٣", "+2", "0x10"]


@pytest.mark.parametrize("kind", ["seconds", "fraction", "gpus", "count"])
@pytest.mark.parametrize("text", NOT_PLAIN_NUMBERS)
def test_a_number_is_read_strictly_in_plain_digits(kind, text):
    from pytest_llmload.config import settings

    setting = next((s for s in SETTINGS if s.kind == kind), None) or SETTINGS[0]
    with pytest.raises(pytest.UsageError, match=re.escape(f"--option={text!r} is ")):
        settings.PARSERS[kind](text, "--option", setting)
    assert settings.PARSERS[kind](" 1 ", "--option", setting) == 1  # (what it reads still)


def test_a_superscript_digit_is_a_usage_error_naming_the_option_not_a_traceback(pytester):
    pytester.makepyfile(READER.format(key="gpus_per_worker"))
    result = pytester.runpytest("-p", "no:randomly", "--llmload-gpus-per-worker", "²")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--llmload-gpus-per-worker='²' is neither a positive number of GPUs nor 'off'*"])
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()

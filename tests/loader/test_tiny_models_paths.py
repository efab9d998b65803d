"""A tiny checkpoint's folder under a locale that cannot give it to tokenizers as UTF-8 (issue 49, point 7): one
sentence naming the folder, the locale and the fix, before anything is built; before, every row errored at set-up
with tokenizers' ``UnicodeEncodeError: ... surrogates not allowed`` after the model was built."""

import os
import subprocess
import sys

BUILD = """
import sys
from pathlib import Path
from pytest_llmload.loader.tiny_models import build_tiny_checkpoint
try:
    build_tiny_checkpoint(Path(sys.argv[1]) / "llama")
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_a_non_ascii_folder_under_lang_c_without_utf8_mode_is_named_with_the_fix(tmp_path):
    folder = tmp_path / "wörkspace"
    folder.mkdir()
    # Python 3.7+ turns UTF-8 mode on by itself under the C locale; a runner's PYTHONUTF8=0 (or an older
    # interpreter's defaults) leaves file names read as ASCII.
    env = {**os.environ, "LANG": "C", "LC_ALL": "C", "PYTHONUTF8": "0"}
    env.pop("PYTHONIOENCODING", None)
    run = subprocess.run([sys.executable, "-c", BUILD, os.fsencode(folder)], env=env, capture_output=True,
                         timeout=120)
    said = run.stdout.decode("utf-8", "replace")
    assert run.returncode == 0 and said.startswith("CheckpointPathError the tiny checkpoint's folder "), said
    assert (f"{ascii(str(folder / 'llama'))} is not UTF-8 text in this process: its locale (LC_ALL=C) makes Python "
            "read file names as 'ascii'") in said, said
    assert "run with PYTHONUTF8=1 (or LC_ALL=C.UTF-8), or give pytest a temp dir in ASCII" in said
    assert not (folder / "llama").exists()  # (nothing half-built)


def test_a_non_ascii_folder_in_a_utf8_process_is_built_as_before(tmp_path):
    from pytest_llmload.loader.tiny_models import _check_tokenizers_can_write

    _check_tokenizers_can_write(tmp_path / "wörkspace" / "日本語")  # (no error: tokenizers takes it)

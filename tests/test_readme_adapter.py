"""The README's adapter sample, as printed, around a correct QLoRA loader (the newcomer's, written from the README
alone) and a training script that applies write-up 003's fix: no check names a known failure (issue 25's done-when).
"""

import re
from pathlib import Path

import pytest

from pytest_llmload.failures import REGISTRY
from pytest_llmload.reports import verdict

README = Path(__file__).resolve().parents[1] / "README.md"

pytestmark = [pytest.mark.llmload_deepspeed, pytest.mark.timeout(300)]


def readme_adapter() -> str:
    """The code block of the README that starts ``# mypkg/llmload_adapter.py``."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    (block,) = [b for b in blocks if b.startswith("# mypkg/llmload_adapter.py")]
    return block


@pytest.fixture
def mypkg(tmp_path, monkeypatch):
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    # The user's own loader: a careful QLoRA loader (fixtures/corpus/readme_newcomer_qlora.py).
    (package / "loading.py").write_text("from fixtures.corpus.readme_newcomer_qlora import load_model_and_tokenizer\n")
    # The user's training script's hook: write-up 003's fix, as the README names it.
    (package / "train.py").write_text(
        "from pytest_llmload.fixes.trainer_guard import prepare_training_args_for_placed_model as prepare_args\n")
    (package / "llmload_adapter.py").write_text(readme_adapter())  # as printed
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    return importlib.import_module("mypkg.llmload_adapter")


@pytest.mark.parametrize("check", [pytest.param(c, id=c.name) for c in REGISTRY if not c.needs_gpus])
def test_the_readme_adapter_as_printed_gets_no_failed_row_on_a_correct_loader(check, mypkg, llmload_checkpoint,
                                                                             tmp_path):
    try:
        check(mypkg.load, llmload_checkpoint, tmp_path)
    except pytest.skip.Exception:
        return
    except Exception as exc:  # noqa: BLE001 - the plugin's own verdict decides
        judged = verdict.of_exception(exc, check.failure)
        assert judged.kind != "failed", judged
        pytest.fail(f"an error row on a correct loader: {judged.sentence}")

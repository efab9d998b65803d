"""The helpers' API page (docs/hooks.py's ``reference/api.md``) and the links to it from a fix's text: made without
MkDocs, so these run everywhere; tests/docs/test_docs_render.py follows the links in the built site."""

import re
from pathlib import Path

import pytest

from fixtures.docs_hooks import docs_hooks

from pytest_llmload.fixes import training_scripts

ROOT = Path(__file__).resolve().parents[2]
PAGE = "../reference/api.md"


@pytest.fixture(scope="module")
def hooks():
    return docs_hooks()


def test_every_public_helper_of_the_fixes_has_an_anchored_entry(hooks):
    page = hooks.api_page()
    anchors = re.findall(r"^#+ .* \{#([\w.]+)\}$", page, re.M)
    assert len(anchors) == len(set(anchors))
    for name in ("device_map_for_rank", "upcast_trainable_parameters", "is_distributed", "local_rank"):
        assert f"pytest_llmload.fixes.training_scripts.{name}" in anchors
        assert f"```python\n{name}(" in page
    # the guard is defined in trainer_guard and re-exported by training_scripts: one entry, where it is defined
    assert "pytest_llmload.fixes.trainer_guard.prepare_training_args_for_placed_model" in anchors
    assert "pytest_llmload.fixes.training_scripts.prepare_training_args_for_placed_model" not in anchors
    assert training_scripts.device_map_for_rank.__doc__.split("\n")[0].strip() in page


FIXES, FAILURES = "pytest_llmload.fixes", "pytest_llmload.failures"


@pytest.mark.parametrize(("text", "links"), [
    (f"use {FIXES}.training_scripts.device_map_for_rank.",
     {f"{FIXES}.training_scripts.device_map_for_rank": f"{FIXES}.training_scripts.device_map_for_rank"}),
    # re-exported through another module (dp-dtype's fix names the guard so), and a sibling after a slash
    (f"({FIXES}.training_scripts.prepare_training_args_for_placed_model / device_map_for_rank)",
     {f"{FIXES}.training_scripts.prepare_training_args_for_placed_model":
      f"{FIXES}.trainer_guard.prepare_training_args_for_placed_model",
      "device_map_for_rank": f"{FIXES}.training_scripts.device_map_for_rank"}),
    # from the module's own name on
    (".to() only when move_offloaded.may_move says so",
     {"move_offloaded.may_move": f"{FAILURES}.move_offloaded.may_move"}),
    # a module
    ("record memory (pytest_llmload.instruments.phases: see",
     {"pytest_llmload.instruments.phases": "pytest_llmload.instruments.phases"}),
    # names that are not the API page's stay text
    ("transformers.integrations.is_deepspeed_zero3_enabled() or LoadRequest.zero_stage; training_args._n_gpu", {}),
])
def test_a_fix_links_each_helper_it_names(hooks, text, links):
    markdown = hooks.linked(text, PAGE)
    assert dict(re.findall(r"\[`([^`]+)`\]\(" + re.escape(PAGE) + r"#([\w.]+)\)", markdown)) == links
    assert re.sub(r"\[`([^`]+)`\]\([^)]*\)", r"\1", markdown).replace("\\", "") == text  # the text itself unchanged

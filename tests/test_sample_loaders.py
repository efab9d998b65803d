"""The whole check suite against every sample loader in fixtures/loaders: exactly the expected checks fail.

Expected failures are strict xfails, so a check that stops failing on a "before" loader (the failure went
away, or the check went blind) fails this test as XPASS(strict), and a loader that breaks none of the checks
(the reference loader, the downstream fixed one) must pass all of them.
"""

from importlib import metadata

import pytest
from packaging.version import Version

from pytest_llmload.conformance import parametrize_with_loader_checks

HONOURS_OFFLOAD_STATE_DICT = Version(metadata.version("transformers")).release < (4, 57)
# transformers <= 4.56's Trainer moves the model to args.device in __init__, and accelerate refuses to move one
# offloaded to cpu/disk (seen on 4.56.2; 4.46.3's check skips first, without 4-bit on CPU). From 4.57 Trainer
# skips the move for a model with an hf_device_map (4.57.6 trainer.py:905).
TRAINER_MOVES_OFFLOADED_MODEL = Version(metadata.version("transformers")).release < (4, 57)
NO_PAD = "write-up 000 fix 3 not applied: the tokenizer has no pad token (its write-up's code never sets one)"
OFFLOADS_TRAIN = "write-up 002: trains a model offloaded by device_map + max_memory (meta parameters)"
DP_WRAP = ("write-up 003: ignores the 4-bit request, so the guard sees an unplaced model and a 2-GPU Trainer "
           "wraps it in DataParallel")

EXPECTED = {
    "fixtures.loaders.before_offload_hang:load": {
        "check_train_request_trains": OFFLOADS_TRAIN,
        "check_train_request_trains_cuda": OFFLOADS_TRAIN,
        "check_pad_token_set_offline": "write-up 000 before: a second GenerationConfig.from_pretrained",
        "check_trainer_does_not_wrap_placed_model": DP_WRAP,
        **({"check_load_writes_only_offload_folder": "offload_state_dict's temp round-trip"}
           if HONOURS_OFFLOAD_STATE_DICT else {}),
    },
    "fixtures.loaders.before_meta_backward:load": {
        "check_train_request_trains": OFFLOADS_TRAIN,
        "check_train_request_trains_cuda": OFFLOADS_TRAIN,
        "check_pad_token_set_offline": NO_PAD,
        "check_trainer_does_not_wrap_placed_model": DP_WRAP,
    },
    "fixtures.loaders.before_dp_dtype:load": {"check_pad_token_set_offline": NO_PAD},
    "fixtures.loaders.before_distributed_device_map:load": {
        "check_train_request_trains": OFFLOADS_TRAIN,
        "check_train_request_trains_cuda": OFFLOADS_TRAIN,
        "check_pad_token_set_offline": NO_PAD,
        "check_distributed_train_step": "write-up 004: device_map='auto' on every rank",
        **({"check_trainer_does_not_wrap_placed_model": "write-up 004's loader offloads the model to disk; this "
            "transformers' Trainer moves it to args.device: 'You can't move a model that has some modules "
            "offloaded to cpu or disk'"} if TRAINER_MOVES_OFFLOADED_MODEL else {}),
    },
    "fixtures.loaders.downstream_fixed:load": {},
    "pytest_llmload.reference_loader:load_model_and_tokenizer": {},
}

pytestmark = [pytest.mark.llmload_deepspeed]


@parametrize_with_loader_checks(list(EXPECTED), expected_failed_checks=lambda loader: EXPECTED[loader.name])
def test_sample_loader(loader, check, llmload_checkpoint, tmp_path):
    check(loader, llmload_checkpoint, tmp_path)

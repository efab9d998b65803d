"""inference-stall (write-up 001): ``generate()`` appears to hang on a model offloaded to cpu/disk.

Not a crash: the write-up's fix was diagnostics (every phase timed, GPU memory before and after, token caps).
This package gives them (:mod:`pytest_llmload.instruments.phases`), and a deadline hit inside ``generate`` is
named as this failure in the report. It has no check of its own: a loader cannot avoid it, only a caller can
cap ``max_new_tokens`` and budget the memory.
"""

from __future__ import annotations

from pytest_llmload.checks.base import Check, KnownFailure
from pytest_llmload.system.tracebacks import HANG_SIGNATURES

FAILURE = KnownFailure(
    id="inference-stall",
    order=3,
    title="generate() appears to hang on an offloaded model",
    write_up="seeds/001_8385e6bc387e2557.txt",
    signatures=HANG_SIGNATURES,
    context=(r"generate|_sample|greedy_search",),
    root_cause=(
        "Generation on a model spread over GPU, CPU and disk streams offloaded weights every token; with a "
        "large max_new_tokens it runs for minutes with no output, which looks like a hang."
    ),
    fix=(
        "Time each phase (tokenize, to-device, generate, decode) and record memory (pytest_llmload.instruments.phases: "
        "see this report's 'llmload: phases' section), cap max_new_tokens, and give the model enough GPU "
        "memory that nothing is offloaded for interactive use."
    ),
    script_fix=(
        "Time each phase (tokenize, to-device, generate, decode) and record memory, cap max_new_tokens, and give the "
        "model enough GPU memory that nothing is offloaded for interactive use."
    ),
    occurs="any version; models larger than GPU memory with cpu/disk offload.",
)


CHECKS: tuple[Check, ...] = ()

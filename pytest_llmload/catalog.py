"""The known failures: one entry per write-up, with the error signatures that identify it.

When a test fails with text matching a signature, the plugin adds a section to the failure report naming
the known failure, its root cause and its fix (see ``known_failure_report.py``).
"""

from __future__ import annotations

import re
from typing import NamedTuple


class KnownFailure(NamedTuple):
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


CATALOG: tuple[KnownFailure, ...] = (
    KnownFailure(
        id="meta-backward",
        title="backward through a model with offloaded (meta) parameters",
        write_up="seeds/002_3bbec781721991d8.txt",
        signatures=(
            r"returned an invalid gradient at index \d+ - expected device meta but got",
            r"Cannot copy out of meta tensor",
            r"Tensor on device meta is not on the expected device",
        ),
        root_cause=(
            "device_map with a max_memory budget offloaded some layers to cpu/disk, so their parameters live on "
            "the meta device and are only materialised inside forward hooks. Autograd then meets gradients for "
            "meta tensors (LoRA weights created on meta, or offloaded weights), which it cannot accumulate."
        ),
        fix=(
            "Never offload a model you train: load it whole on one device (device_map={'': device} or None), use "
            "gradient checkpointing, LoRA, 4-bit or a smaller batch to fit, and refuse a budget that cannot hold it."
        ),
        occurs="transformers 4.x-5.x with accelerate offload; any device (cuda:0 on GPU, cpu on CPU).",
    ),
    KnownFailure(
        id="distributed-device-map",
        title="device_map='auto' under DeepSpeed or another distributed launcher",
        write_up="seeds/004_e47582475487edd3.txt",
        signatures=(
            r"You can't train a model that has been loaded with `?device_map='auto'`? in any distributed mode",
            r"You can't train a model that has been loaded in 8-bit or 4-bit precision on multiple devices in any "
            r"distributed mode",
        ),
        root_cause=(
            "Each rank loaded the model with device_map='auto', which spreads it over several devices "
            "(hf_device_map has more than one entry). accelerate refuses to prepare such a model for DeepSpeed or "
            "DDP, which place and replicate the model themselves."
        ),
        fix=(
            "When WORLD_SIZE/RANK/LOCAL_RANK (or a DeepSpeed flag) say the process is one rank of a job, load "
            "without device_map, or pin the whole model to the rank's device (device_map={'': local_rank})."
        ),
        occurs="accelerate >= 0.20 with DistributedType DEEPSPEED, MULTI_GPU or MULTI_CPU; CPU (gloo) and GPU.",
    ),
    KnownFailure(
        id="dp-dtype",
        title="nn.DataParallel wrapped around a model already placed with device_map",
        write_up="seeds/003_b296b1821f4bec50.txt",
        signatures=(
            r"mat1 and mat2 (?:to |must )?have the same dtype",
            r"expected scalar type (?:Float|BFloat16|Half) but found (?:Float|BFloat16|Half)",
        ),
        root_cause=(
            "Trainer saw n_gpu > 1 and wrapped a device_map-placed (4-bit, LoRA) model in nn.DataParallel; its "
            "replicas run in worker threads and float activations reach a bf16 lm_head. The tell: the number of "
            "steps halves (136 -> 68)."
        ),
        fix=(
            "Do not let Trainer data-parallelise a placed model: set training_args._n_gpu = 1 when hf_device_map "
            "spreads the model (pytest_llmload.trainer_guard does this), or launch one process per GPU instead."
        ),
        occurs="2+ GPUs; transformers Trainer up to 4.57 wraps 4-bit models, later versions skip 4-bit.",
        tell=r"data_parallel|parallel_apply",
        without_tell=(
            "no DataParallel frame in the traceback: the same dtype symptom, so look for another float/bf16 mix "
            "(autocast off, a module left in float32)."
        ),
    ),
    KnownFailure(
        id="offload-hang",
        title="from_pretrained never returns after the shards load (offload_state_dict round-trip)",
        write_up="seeds/000_90648e437c1c073a.txt",
        signatures=(r"Timeout \(>[\d.]+s\) from pytest-timeout", r"deadline .* exceeded", r"Timed out after"),
        context=(r"from_pretrained|load_state_dict|offload",),
        root_cause=(
            "With offload_state_dict=True and a budget that offloads, transformers <= 4.56 writes every CPU-bound "
            "weight to a temporary directory and reads it back after the progress bar ends, with no output: "
            "minutes of silence on a 70B model that look like a hang."
        ),
        fix=(
            "Drop offload_state_dict (transformers >= 4.57 ignores it), keep offload_folder only where disk "
            "offload is wanted, and set pad_token_id directly instead of a second GenerationConfig.from_pretrained."
        ),
        occurs="transformers <= 4.56 with device_map + max_memory + offload_folder; any hardware, worst on big models.",
    ),
    KnownFailure(
        id="inference-stall",
        title="generate() appears to hang on an offloaded model",
        write_up="seeds/001_8385e6bc387e2557.txt",
        signatures=(r"Timeout \(>[\d.]+s\) from pytest-timeout", r"deadline .* exceeded", r"Timed out after"),
        context=(r"generate|_sample|greedy_search",),
        root_cause=(
            "Generation on a model spread over GPU, CPU and disk streams offloaded weights every token; with a "
            "large max_new_tokens it runs for minutes with no output, which looks like a hang."
        ),
        fix=(
            "Time each phase (tokenize, to-device, generate, decode) and record memory (pytest_llmload.phases: "
            "see this report's 'llmload: phases' section), cap max_new_tokens, and give the model enough GPU "
            "memory that nothing is offloaded for interactive use."
        ),
        occurs="any version; models larger than GPU memory with cpu/disk offload.",
    ),
)

BY_ID = {failure.id: failure for failure in CATALOG}


def match(text: str) -> list[KnownFailure]:
    """The known failures whose signatures appear in ``text`` (a failure's message and traceback)."""
    return [failure for failure in CATALOG if failure.matches(text)]

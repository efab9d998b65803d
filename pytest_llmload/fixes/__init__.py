"""The fixes, for training scripts and loaders, with no pytest in them: the helpers a script calls
(:mod:`.training_scripts`: a device map per rank, upcasting trainable parameters), the Trainer guard
(:mod:`.trainer_guard`), the training memory estimate (:mod:`.training_memory`), the adapter fix (:mod:`.adapters`: a
PEFT adapter never put on an offloaded base) and the built-in reference loader that applies every write-up's fix
(:mod:`.reference_loader`). ``from pytest_llmload.fixes import ...`` gives the
helpers of :mod:`.training_scripts`, as before the package had folders."""

from pytest_llmload.fixes.training_scripts import (  # noqa: F401  (the public path of the helpers)
    device_map_for_rank,
    is_distributed,
    local_rank,
    upcast_trainable_parameters,
)

"""A repo's own command run on tiny weights (``python -m pytest_llmload run [options] -- COMMAND...``): the command
started unchanged with a bootstrap every Python process it starts imports (:mod:`.bootstrap`), which there gives
every ``from_pretrained`` a tiny checkpoint of the same architecture (:mod:`.tiny_weights`), bounds the run and
records what the known failures' mechanisms need (:mod:`.in_process`); the parent (:mod:`.command`) enforces one
deadline, reads every process's findings and makes one row per known failure plus the command's own
(:mod:`.rows`), printed by the main job's table (:mod:`.cli`). The top layer: it reuses the main job's printing."""

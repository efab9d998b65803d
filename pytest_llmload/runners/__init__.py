"""Running test code elsewhere: in a forked child (:mod:`.isolation`, behind the ``llmload_isolated`` marker
in :mod:`.isolated_marker`) and on the ranks of a real process group (:mod:`.ranks`, behind ``distributed_env``)."""

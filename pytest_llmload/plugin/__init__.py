"""The pytest plugin, every hook and sub-plugin of it: the hooks pytest calls on every run (:mod:`.hooks`, the entry
point ``pytest11: llmload`` names this package, which carries them), the fixtures, the markers and their one reader,
the check registry and ``parametrize_with_loader_checks``, and the sub-plugins (isolated tests, xdist GPUs, a launched
run, memory limits, the phase state), each registered once by the hooks as a light gate that imports it when
the run's one flag for it says the run needs it (``gates.SUB_PLUGINS``)."""

from pytest_llmload.plugin.hooks import *  # noqa: F401,F403  (the hooks and fixtures pytest finds on the entry point's module)

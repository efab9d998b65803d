"""Process primitives: running test code in other processes and hearing back from them, with no pytest hooks and no
verdicts. One path starts every child (:mod:`.children`: isolated calls and checks, ranks, a launched job's rank),
from this process or from the warm forkserver (:mod:`.warm_server`); a child's output, log records and stacks come
back through :mod:`.child_output`, its one answer and every other value that crosses a process boundary through
:mod:`.wire` (pickles from a child, signed plain data through a store); :mod:`.lifeline` ties each process to its
parent and ends what a child started; :mod:`.child_coverage` measures children where the parent measures. On top of
them: one isolated call with its deadline (:mod:`.isolation`, behind the ``llmload_isolated`` marker and
``Check(isolated=True)``), a function on the ranks of a real process group (:mod:`.ranks`, behind
``distributed_env``; a rank's work reports a :class:`~.ranks.RankResult`), what children and ranks import imported
once before they fork (:mod:`.preload`), and the launcher's job this process may be a rank of, with the ranks'
meeting point (:mod:`.launcher`; its pytest hooks are :mod:`pytest_llmload.plugin.launched_run`)."""

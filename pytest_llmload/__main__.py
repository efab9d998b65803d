"""``python -m pytest_llmload`` (and the ``llmload`` console script): the main job, see :mod:`pytest_llmload.main_job`;
``python -m pytest_llmload run [options] -- COMMAND...``: the repo's own command on tiny weights, see
:mod:`pytest_llmload.commands`."""

import sys

RUN_SUBCOMMAND = "run"


def main() -> None:
    if sys.argv[1:2] == [RUN_SUBCOMMAND]:
        from pytest_llmload.commands.cli import main as run_command

        sys.exit(run_command(sys.argv[2:]))
    from pytest_llmload.main_job.cli import run

    sys.exit(run())


if __name__ == "__main__":
    main()

"""``python -m pytest_llmload`` (and the ``llmload`` console script): the main job, see :mod:`pytest_llmload.main_job`."""

import sys


def main() -> None:
    from pytest_llmload.main_job.cli import run

    sys.exit(run())


if __name__ == "__main__":
    main()

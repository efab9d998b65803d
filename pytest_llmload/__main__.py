"""``python -m pytest_llmload`` (and the ``llmload`` console script): the main job, see ``main_job.py``."""

import sys


def main() -> None:
    from pytest_llmload.main_job.job import run

    sys.exit(run())


if __name__ == "__main__":
    main()

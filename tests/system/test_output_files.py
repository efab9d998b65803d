"""Output files (--log, --json, --llmload-html, pytest's --junitxml, the progress file) never follow a link another
user could have planted in a directory others can write (issue 49, point 4); a link in one's own directory is one's
own, and followed as before."""

import os
import stat

import pytest

from fixtures import warm_runs
from pytest_llmload.system.output_files import UnsafeOutputFile, open_output, open_output_fd, unsafe_reason

SECRET = "the job user's own file\n"


@pytest.fixture
def shared(tmp_path):
    """A sticky directory everyone can write (a shared /tmp), with another user's link in it aimed at a file of
    the job's user."""
    directory = tmp_path / "shared"
    directory.mkdir()
    directory.chmod(0o1777)
    target = tmp_path / "mine.txt"
    target.write_text(SECRET)
    (directory / "out.log").symlink_to(target)
    return directory, target


def test_a_link_planted_in_a_shared_directory_is_refused_and_its_target_untouched(shared):
    directory, target = shared
    link = directory / "out.log"
    assert unsafe_reason(link).startswith(f"is a symbolic link in {str(directory)!r}, a directory other users can "
                                          f"write: the link may be another user's, aimed at a file of yours; name "
                                          f"the file itself ({str(target)!r})")
    for append in (False, True):
        with pytest.raises(UnsafeOutputFile, match="is a symbolic link in"):
            open_output(link, append=append)
    assert target.read_text() == SECRET
    (directory / "missing").symlink_to(directory.parent / "created-by-us")  # (a link to a file not there yet)
    with pytest.raises(UnsafeOutputFile):
        open_output_fd(directory / "missing")
    assert not (directory.parent / "created-by-us").exists()


def test_a_link_to_a_shared_directory_on_the_way_is_refused(shared):
    directory, target = shared
    (directory / "logs").symlink_to(target.parent)
    assert "goes through" in unsafe_reason(directory / "logs" / "mine.txt")


def test_a_hard_link_or_another_users_file_in_a_shared_directory_is_refused(shared):
    directory, target = shared
    os.link(target, directory / "hard.log")
    assert "has 2 names (a hard link)" in unsafe_reason(directory / "hard.log")
    with pytest.raises(UnsafeOutputFile):
        open_output(directory / "hard.log")
    assert target.read_text() == SECRET
    if os.geteuid() == 0:  # (only root can give a file away)
        theirs = directory / "theirs.log"
        theirs.write_text("theirs\n")
        os.chown(theirs, 65534, 65534)
        assert "is a file of another user (uid 65534)" in unsafe_reason(theirs)


def test_a_new_or_own_file_in_a_shared_directory_and_a_link_in_ones_own_are_written(shared, tmp_path):
    directory, target = shared
    with open_output(directory / "new.log") as log:
        log.write("one\n")
    with open_output(directory / "new.log", append=True) as log:
        log.write("two\n")
    with open_output(directory / "new.log") as log:  # (truncated: written anew)
        log.write("three\n")
    assert (directory / "new.log").read_text() == "three\n"
    assert stat.S_IMODE((directory / "new.log").stat().st_mode) == 0o666 & ~_umask()
    own = tmp_path / "latest.log"
    own.symlink_to(target)  # the user's own link, in the user's own directory
    assert unsafe_reason(own) is None
    with open_output(own, append=True) as log:
        log.write("more\n")
    assert target.read_text() == SECRET + "more\n"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("args", [("--log", "{link}"), ("--json", "{link}"), ("--", "--junitxml={link}"),
                                  ("--", "--llmload-html", "{link}")], ids=["log", "json", "junitxml", "html"])
def test_the_main_job_refuses_a_planted_link_before_the_run(shared, args):
    directory, target = shared
    link = directory / "out.log"
    run = warm_runs.main_job(*(arg.format(link=link) for arg in args), cwd=directory.parent)
    option = args[1].split("=")[0] if args[0] == "--" else args[0]
    assert run.returncode == 4 and run.stdout == "", run.stdout + run.stderr
    assert run.stderr.startswith(f"llmload: error: {option} {str(link)!r} is a symbolic link in "), run.stderr
    assert target.read_text() == SECRET


def test_the_html_report_through_a_planted_link_is_a_usage_error_before_the_run(shared, pytester):
    directory, target = shared
    pytester.makepyfile("def test_one():\n    pass\n")
    link = directory / "out.log"
    result = pytester.runpytest_inprocess("-p", "no:randomly", "--llmload-html", str(link))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--llmload-html {str(link)!r} is a symbolic link in {str(directory)!r}, a "
                                 "directory other users can write*"])
    assert target.read_text() == SECRET


def test_a_progress_file_through_a_planted_link_is_a_usage_error(shared, pytester):
    directory, target = shared
    pytester.makepyfile("def test_one():\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "no:randomly", "--llmload-progress", str(directory / "out.log"))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--llmload-progress * cannot be opened for appending (UnsafeOutputFile: *is a "
                                 "symbolic link in*"])
    assert target.read_text() == SECRET

"""Phase timings and the heartbeat, as a script meets them (no pytest plugin in the way): real memory
figures, a fake clock for the heartbeat, no sleeps."""

from __future__ import annotations

import math

import pytest

from pytest_llmload.instruments import memory_probe
from pytest_llmload.instruments.heartbeat import Heartbeat
from pytest_llmload.instruments.phases import phase, timed_generate
from pytest_llmload.instruments.recorder import PhaseRecorder, recording

pytestmark = pytest.mark.timeout(60)
MiB = 2**20


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


needs_peak_reset = pytest.mark.skipif(memory_probe._clear_refs_fd is None,
                                      reason="/proc/self/clear_refs cannot be written here: RSS peaks are not measured")


@needs_peak_reset
def test_an_inner_peak_is_kept_by_the_outer_phase_although_the_inner_one_resets_the_counter():
    with recording() as record:
        with phase("outer") as outer:
            with phase("inner", what="64 MiB") as inner:
                block = b"\x01" * (64 * MiB)  # written, so resident
                del block
            with phase("after") as after:
                pass
    assert inner.rss_peak - inner.rss_before >= 60 * MiB, record.table()
    assert outer.rss_peak >= inner.rss_peak, record.table()  # folded in before "after" reset the counter
    assert after.rss_peak < inner.rss_peak - 32 * MiB, record.table()  # "after" saw none of it
    assert [p.name for p in record.phases] == ["outer", "inner", "after"]
    assert [p.depth for p in record.phases] == [0, 1, 1]


def test_a_phase_that_raises_is_the_one_the_table_marks():
    with recording("script") as record:
        with phase("load"):
            pass
        with pytest.raises(ValueError):
            with phase("generate", max_new_tokens=512):
                raise ValueError("out of memory, say")
    assert record.interrupted().name == "generate"
    rows = record.table().splitlines()
    assert rows[0].split()[:3] == ["phase", "seconds", "RSS"]
    assert rows[1].startswith("   load ")  # not marked
    assert rows[2].startswith(">  generate (max_new_tokens=512) ")
    assert rows[2].endswith("raised ValueError: out of memory, say")


def test_outside_a_recording_a_phase_still_times_itself():
    with phase("tokenize") as p:
        p.note(tokens=7)
    assert p.label == "tokenize (tokens=7)" and p.seconds >= 0 and not p.running and p.error is None


def test_heartbeat_calls_a_repeating_callback_when_due_and_catches_up_without_a_burst():
    clock, calls = FakeClock(), []
    beat = Heartbeat(clock, start_thread=False)
    beat.schedule("generate", 5.0, calls.append, every=5.0)
    beat.schedule("deadline", 12.0, calls.append)  # one-shot
    assert beat.run_due(104.9) == 105.0 and calls == []
    assert beat.run_due(105.0) == 110.0 and calls == ["generate"]
    assert beat.run_due(113.0) == 115.0 and calls == ["generate", "generate", "deadline"]  # one line, not two
    beat.cancel("generate")
    assert beat.run_due(200.0) == math.inf and calls == ["generate", "generate", "deadline"]


def test_a_recorder_prints_progress_while_a_phase_runs_and_stops_when_it_ends():
    clock, lines = FakeClock(), []
    beat = Heartbeat(clock, start_thread=False)
    recorder = PhaseRecorder("tests/test_x.py::test_y", progress_every=5.0, emit=lines.append, clock=clock,
                             heartbeat=beat)
    with recording(recorder=recorder):
        with phase("generate", max_new_tokens=512) as p:
            clock.now += 4.0
            beat.run_due()
            assert lines == [] and not p.progressed.is_set()
            clock.now += 2.0
            beat.run_due()
            assert p.progressed.is_set()
            clock.now += 60.0
            beat.run_due()
        clock.now += 60.0
        beat.run_due()
    assert len(lines) == 2, lines
    assert lines[0].startswith("llmload: tests/test_x.py::test_y: phase 'generate (max_new_tokens=512)' running "
                               "for 6.0 s; RSS "), lines
    assert "running for 66 s" in lines[1]


def test_no_progress_is_scheduled_when_it_is_turned_off():
    beat = Heartbeat(FakeClock(), start_thread=False)
    with recording(recorder=PhaseRecorder(progress_every=0, heartbeat=beat)):
        with phase("generate"):
            assert beat._due == {}


def test_timed_generate_times_the_four_steps_of_write_up_001(llmload_load):
    model, tokenizer = llmload_load()
    with recording() as record:
        texts = timed_generate(model, tokenizer, ["hello world"], max_new_tokens=4, do_sample=False)
    assert len(texts) == 1
    assert [p.name for p in record.phases] == ["tokenize", "to device", "generate", "decode"]
    assert record.phases[0].detail.startswith("prompts=1, tokens=")
    assert record.phases[2].detail == "max_new_tokens=4, do_sample=False"
    assert all(p.rss_before and p.rss_after and p.error is None for p in record.phases)


def test_the_documented_entry_points_are_importable_from_phases():
    # reference/api.md documents recording beside phase(), docs/diagnostics.md track_model: both defined in recorder.
    from pytest_llmload.instruments import phases, recorder

    assert phases.recording is recorder.recording and phases.track_model is recorder.track_model

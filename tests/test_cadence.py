"""The worker loop's cadences, without Ray or a device."""

from __future__ import annotations

from zerolab.cadence import STOPPED_AT_DEADLINE, STOPPED_ON_REQUEST, Cadence


def test_windows_and_checkpoints_fall_on_their_steps():
    c = Cadence(total_steps=23, log_every=5, checkpoint_every=10)
    assert [d for d in range(1, 24) if c.logs(d)] == [5, 10, 15, 20, 23]
    assert [d for d in range(1, 24) if c.checkpoints(d, 0)] == [10, 20, 23]
    assert c.checkpoints(7, STOPPED_ON_REQUEST)  # a stop always saves


def test_under_tune_every_window_is_reported_once():
    c = Cadence(total_steps=20, log_every=5, checkpoint_every=10, report_every_log=True)
    assert [d for d in range(1, 21) if c.reports_window(d, 0)] == [5, 15]  # 10 and 20 go with their checkpoints
    assert not Cadence(total_steps=20, log_every=5).reports_window(5, 0)


def test_the_deadline_stops_a_window_early_and_outranks_a_request():
    asked = []

    def requested() -> bool:
        asked.append(True)
        return True

    c = Cadence(total_steps=100, log_every=10, deadline_unix=1000.0)
    assert c.stop_code(now=900.0, window_s=60.0, requested=lambda: False) == 0  # the next window ends at 960
    assert c.stop_code(now=950.0, window_s=60.0, requested=requested) == STOPPED_AT_DEADLINE and not asked
    assert c.stop_code(now=900.0, window_s=60.0, requested=requested) == STOPPED_ON_REQUEST and asked
    assert Cadence(total_steps=100, log_every=10).stop_code(now=1e12, window_s=1e6, requested=lambda: False) == 0

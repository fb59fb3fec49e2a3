"""`deploy.supervisor`: capped exponential backoff, and the crash loop after which a child is left dead."""
import pytest

from epdserve.deploy.local.supervisor import RestartPolicy, RestartSchedule


def test_backoff_doubles_up_to_its_cap_then_a_crash_loop():
    sch = RestartSchedule(RestartPolicy(first_backoff_s=0.5, max_backoff_s=3.0, max_restarts=4, stable_after_s=60), 0.0)
    delays, now = [], 0.0
    for _ in range(4):
        now += 1.0  # each run ends soon after its start
        delays.append(sch.exited(now))
        assert not sch.is_due(now) and sch.is_due(now + delays[-1])
        now += delays[-1]
        sch.started(now)
    assert delays == [0.5, 1.0, 2.0, 3.0]
    assert sch.exited(now + 1.0) is None and sch.gave_up and sch.due is None
    assert sch.restarts == 4


def test_a_child_that_ran_long_enough_starts_a_fresh_count():
    sch = RestartSchedule(RestartPolicy(first_backoff_s=1.0, max_backoff_s=8.0, max_restarts=2, stable_after_s=30), 0.0)
    assert sch.exited(5.0) == 1.0
    sch.started(6.0)
    assert sch.exited(7.0) == 2.0
    sch.started(9.0)
    assert sch.exited(100.0) == 1.0  # ran 91 s: healthy again, so no crash loop
    assert not sch.gave_up


@pytest.mark.parametrize("kw", [dict(first_backoff_s=-1), dict(first_backoff_s=5, max_backoff_s=1),
                                dict(max_restarts=-1), dict(stable_after_s=0)])
def test_bad_policies_are_refused(kw):
    with pytest.raises(ValueError):
        RestartPolicy(**kw)

"""A process for the StopSignals tests: `python -m tests.reliability.stop_target DEADLINE MODE`.

MODE "wait": the main thread waits for the stop request the way the instance did when it
deadlocked (Event.wait in a loop, a Condition taken in between), then prints "stopped" and exits 0.
MODE "hang": after the stop request the main thread blocks forever; the deadline must end it.
"""
import sys
import threading

from epdserve.deploy.local.signals import StopSignals, parent_pid_from_env

stop = StopSignals(deadline_s=float(sys.argv[1]), parent_pid=parent_pid_from_env(), name="stop_target").install()
print("ready", flush=True)
if sys.argv[2] == "wait":
    cond = threading.Condition()
    while not stop.wait(0.001):
        with cond:
            cond.notify_all()
    stop.stopped()
    print("stopped", flush=True)
else:
    stop.wait()
    threading.Event().wait()

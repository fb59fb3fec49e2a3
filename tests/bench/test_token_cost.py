"""The served-token breakdown's pieces (epdserve/bench/token_cost.py): py-spy stacks counted by stage,
and a launched deployment's processes found by their command lines."""
from epdserve.bench.token_cost import STAGE_NAMES, classify_stacks, stage_of

RAW = """\
Thread._bootstrap (threading.py:1002);StageWorker.tick (epdserve/instance/worker.py:294);LLMEngine.step (epdserve/engine/llm_engine.py:321);ModelRunner.forward (epdserve/engine/model_runner.py:10);LeanLM.forward (epdserve/engine/lm/forward.py:99);DenseLinear.__call__ (epdserve/engine/lm/linear.py:48) 40
Thread._bootstrap (threading.py:1002);StageWorker.tick (epdserve/instance/worker.py:294);LLMEngine._encode_step (epdserve/engine/llm_engine.py:388);EncodeStage.step (epdserve/engine/encode_stage.py:139);Linear.forward (torch/nn/modules/linear.py:134) 7
Thread._bootstrap (threading.py:1002);StageWorker.tick (epdserve/instance/worker.py:294);LLMEngine.step (epdserve/engine/llm_engine.py:321);Scheduler.schedule (epdserve/engine/scheduler.py:80) 5
_run (grpc/_server.py:500);Servicer.Generate (epdserve/instance/servicer.py:40);SerializeToString (google/protobuf/message.py:10) 3
_run (grpc/_server.py:500);Servicer.Generate (epdserve/instance/servicer.py:40) 2
run (uvicorn/server.py:60);chat (epdserve/entrypoints/http/chat.py:30);Dispatcher.generate (epdserve/scheduler/dispatcher.py:77) 4
run (uvicorn/server.py:60);stream (epdserve/entrypoints/http/sse.py:12) 6
BaseEventLoop._run_once (asyncio/base_events.py:1900);EpollSelector.select (selectors.py:468) 9
main (somewhere.py:1) 1
not a stack line
"""


def test_stacks_are_counted_by_their_innermost_stage():
    counts = classify_stacks(RAW)
    assert counts == {"lm-forward": 40, "vision": 7, "engine-step": 5, "grpc": 3, "rpc-handlers": 2,
                      "scheduler": 4, "http-front": 6, "asyncio": 9, "other": 1}
    assert set(counts) <= set(STAGE_NAMES)
    # a torch frame inside the vision encoder is vision, not the language model
    assert stage_of(["EncodeStage.step (epdserve/engine/encode_stage.py:1)", "mm (torch/functional.py:1)"]) == "vision"


def test_the_processes_of_a_launch_are_named_by_role():
    """Real processes under a stand-in launcher, with the command lines deploy/local/deployment.py gives
    its children (each only waits to be killed): found by role, two instances of one role numbered."""
    import subprocess
    import sys

    from epdserve.bench.token_cost import process_roles
    from tests.harness import wait_until

    kids = [["-m", "epdserve.entrypoints.scheduler_cli", "--port", "1"], ["instance", "--roles", "D"],
            ["instance", "--roles", "D"], ["instance", "--roles", "EP"], ["valkey-server", "--port", "9"]]
    spawn = ("import signal, subprocess, sys\n"
             f"ps = [subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()', *a]) for a in {kids!r}]\n"
             "print('up', flush=True); signal.pause()")
    launcher = subprocess.Popen([sys.executable, "-c", spawn], stdout=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout.readline().strip() == "up"
        wait_until(lambda: len(process_roles(launcher.pid)) == 6, 30, "the six processes")
        roles = process_roles(launcher.pid)
        assert set(roles) == {"launcher", "scheduler", "instance:D", "instance:D#2", "instance:EP", "mm_store"}
        assert roles["launcher"] == launcher.pid and len(set(roles.values())) == 6
    finally:
        import psutil

        for p in psutil.Process(launcher.pid).children(recursive=True):
            p.kill()
        launcher.kill()
        launcher.wait()

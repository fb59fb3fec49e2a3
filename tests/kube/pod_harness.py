"""A rendered release run on this machine without a cluster: every pod one local process group.

`LoopbackCluster(values, root)` renders the release (`epdserve.deploy.kube.render`) and plays the parts
of Kubernetes a test needs: the kubelet (start a container's command + args with the env the pod
gets: downward-API fields and Secret keys filled in, `$(VAR)` expanded: `epdserve.deploy.kube.podview`;
probe it with the container's own readiness probe: grpc.health.v1 on its port and service, or a
TCP connect), the cluster DNS and Services (names -> the pods' addresses), a Deployment replacing
a killed pod (a new pod: new name, new IP) and scaling (one more pod of the template).

Every pod has its own IP on the loopback (Linux routes all of 127/8 to `lo`): 127.X.Y.N, with
X.Y drawn per cluster so two runs on one machine do not meet. `local_rewrites` is the one place
where what runs differs from the pod spec; its docstring lists each rewrite and why.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from epdserve.deploy.kube.meta import mm_store_name, scheduler_internal_name, scheduler_name
from epdserve.deploy.kube.podview import container_argv, container_env
from epdserve.deploy.kube.ports import Ports
from epdserve.deploy.kube.render import pod_templates, render
from epdserve.deploy.kube.values import KubeValues
from epdserve.ops.native_build import cache_root
from tests.kube.kubelet_probe import probe, probe_port

_POD_SUFFIX = "bcdfghjklmnpqrstvwxz2456789"  # the letters a ReplicaSet's pod names end in
PROBE_EVERY_S = 0.25  # the kubelet probes every periodSeconds (5 s); a test need not wait that long


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free on every interface right now (the processes bind them later)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("0.0.0.0", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def loopback_ports() -> Ports:
    """The release's ports, free here: rendered with them, so no rewrite of a port is needed."""
    scheduler, internal, http, instance, mm_store = free_ports(5)
    return Ports(scheduler=scheduler, internal=internal, http=http, instance=instance, mm_store=mm_store)


def image_env(ops_cache: Path) -> dict[str, str]:
    """What the image's own ENV would give: this machine's environment without any EPDSERVE_*
    variable (the pod spec is the only source of those) but the Dockerfile's EPDSERVE_OPS_CACHE
    (`ops_cache`: where `prepare` built the native operators), with this venv's `epdserve`
    first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPDSERVE_")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "/usr/bin:/bin")])
    env["EPDSERVE_OPS_CACHE"] = str(ops_cache)
    return env


def local_rewrites(argv: list[str], *, dns: dict[str, str], pod_ip: str, mounts: dict[str, Path]) -> list[str]:
    """argv as the pod spec gives it (`container_argv`) -> argv run here. The only differences:

    - cluster DNS names (`dns`: the headless Service's `<release>-scheduler-N.<release>-scheduler-
      internal` per scheduler pod, the Service `<release>-mm-store`) -> that pod's loopback IP,
      wherever a name stands before `:port`. Ports are unchanged: the release is rendered with
      ports free on this machine (`loopback_ports`), and every pod has an IP of its own.
    - `0.0.0.0` -> the pod's IP: in a pod, "every interface" means the pod's own network
      namespace; here all pods share `lo`, so two schedulers binding 0.0.0.0 on one port would
      collide. Each binds its own IP instead, on the port the Service targets.
    - a volume's mountPath (`mounts`: `/models`, the Redis conf `emptyDir`) -> a folder here.
    """
    names = re.compile(r"(?<![\w.-])(" + "|".join(re.escape(n) for n in sorted(dns, key=len, reverse=True))
                       + r")(?=:\d)") if dns else None
    paths = re.compile(r"(?<![\w./-])(" + "|".join(re.escape(p) for p in sorted(mounts, key=len, reverse=True))
                       + r")(?![\w.-])") if mounts else None
    out = []
    for word in argv:
        if names is not None:
            word = names.sub(lambda m: dns[m.group(1)], word)
        if paths is not None:  # one pass: a folder put in is not rewritten again
            word = paths.sub(lambda m: str(mounts[m.group(1)]), word)
        out.append(pod_ip if word == "0.0.0.0" else word)
    return out


@dataclass
class Pod:
    name: str
    ip: str
    workload: dict
    container: dict
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen
    log: Path

    @property
    def address(self) -> str:
        """The pod IP and the readiness probe's port (the container's main port)."""
        return f"{self.ip}:{probe_port(self.container)}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def kill(self) -> None:
        """kill -9 of the pod's every process (a node or container runtime losing it)."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@dataclass
class LoopbackCluster:
    values: KubeValues
    root: Path
    objects: list[dict] = field(init=False)
    pods: list[Pod] = field(default_factory=list)
    dns: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        self.objects = render(self.values)
        self.secrets = {o["metadata"]["name"]: o["stringData"] for o in self.objects if o["kind"] == "Secret"}
        self._net = f"127.{random.randrange(1, 255)}.{random.randrange(0, 255)}"
        self._next_host = 2
        self.models = self.root / "models"
        self.ops_cache = cache_root()  # the suite's own: the image's, built once (`prepare`)

    # --- the objects ---------------------------------------------------------------------------

    def workload(self, name: str) -> dict:
        return next(o for o, _ in pod_templates(self.objects) if o["metadata"]["name"] == name)

    def workloads(self, kind: str | None = None, component: str | None = None) -> list[dict]:
        return [o for o, _ in pod_templates(self.objects) if (kind is None or o["kind"] == kind)
                and (component is None or o["metadata"]["labels"]["app.kubernetes.io/component"] == component)]

    @property
    def api_key(self) -> str:
        return self.secrets[self.values.secret_name]["api-key"]

    def service_targets(self) -> list[str]:
        """The scheduler Service's endpoints: each live scheduler pod's IP and the Service's port."""
        port = self.values.ports.scheduler
        return [f"{p.ip}:{port}" for p in self.pods
                if p.alive() and p.workload["metadata"]["name"] == scheduler_name(self.values)]

    def pods_of(self, name: str) -> list[Pod]:
        return [p for p in self.pods if p.alive() and p.workload["metadata"]["name"] == name]

    # --- the kubelet ---------------------------------------------------------------------------

    def prepare(self) -> None:
        """What exists before a pod starts, both at once: the image's native operators
        (Dockerfile: `RUN epdserve build-ops` into its EPDSERVE_OPS_CACHE; here the suite's cache,
        where the build ran once for every test: a stamped build loads without a lock, and a build
        holds an flock that dies with its holder, so a killed pod leaves nothing behind) and the
        demo checkpoint, written once by the init container's own
        command: every pod's init container writes the same files (one seed), so one copy serves
        every pod's `/models`."""
        [init] = {json.dumps(c, sort_keys=True): c for _, spec in pod_templates(self.objects)
                  for c in spec.get("initContainers", [])}.values()  # the same one in every pod
        init_argv = local_rewrites(container_argv(init, container_env(init, {}, self.secrets)), dns={}, pod_ip="",
                                   mounts={"/models": self.models})
        steps = {"build-ops": ["epdserve", "build-ops"], "init-demo-model": init_argv}
        procs = {}
        for name, argv in steps.items():
            with open(self.root / f"{name}.log", "w") as out:
                procs[name] = subprocess.Popen(argv, env=image_env(self.ops_cache), stdout=out,
                                               stderr=subprocess.STDOUT, start_new_session=True)
        try:
            for name, proc in procs.items():
                assert proc.wait(300) == 0, (self.root / f"{name}.log").read_text()
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()

    def start_pod(self, workload: dict, name: str | None = None) -> Pod:
        """One pod of `workload`'s template (its one container; init containers: `prepare`):
        a StatefulSet's next ordinal, or a Deployment's pod under a fresh name. Not yet ready."""
        wname = workload["metadata"]["name"]
        if name is None:
            if workload["kind"] == "StatefulSet":
                name = f"{wname}-{sum(1 for p in self.pods if p.workload is workload)}"
            else:
                name = f"{wname}-{_template_hash(workload)}-{''.join(random.choices(_POD_SUFFIX, k=5))}"
        ip = f"{self._net}.{self._next_host}"
        self._next_host += 1
        if workload["kind"] == "StatefulSet":  # stable DNS names: the headless Service's, and the MM Store's
            if wname == scheduler_name(self.values):
                self.dns[f"{name}.{scheduler_internal_name(self.values)}"] = ip
            elif wname == mm_store_name(self.values):
                self.dns[wname] = ip
        [c] = workload["spec"]["template"]["spec"]["containers"]
        pod_dir = self.root / "pods" / name
        pod_dir.mkdir(parents=True)
        mounts = {m["mountPath"]: (self.models if m["mountPath"] == "/models" else pod_dir / m["name"])
                  for m in c.get("volumeMounts", [])}
        for local in mounts.values():
            local.mkdir(exist_ok=True)
        env = container_env(c, {"status.podIP": ip, "metadata.name": name}, self.secrets)
        argv = local_rewrites(container_argv(c, env), dns=self.dns, pod_ip=ip, mounts=mounts)
        log = pod_dir / "log"
        with open(log, "w") as out:
            proc = subprocess.Popen(argv, env={**image_env(self.ops_cache), **env}, cwd=pod_dir, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        pod = Pod(name, ip, workload, c, argv, env, proc, log)
        self.pods.append(pod)
        return pod

    def wait_ready(self, pods: list[Pod], timeout_s: float = 360) -> None:
        """Until each pod's readiness probe passes; AssertionError with its log if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        waiting = list(pods)
        while waiting:
            for p in list(waiting):
                assert p.alive(), f"pod {p.name} exited {p.proc.returncode}:\n{p.tail()}"
                if probe(p.container, p.ip):
                    waiting.remove(p)
            if waiting and time.monotonic() > deadline:
                raise AssertionError(f"not ready in {timeout_s} s: {[p.name for p in waiting]}\n{waiting[0].tail()}")
            time.sleep(PROBE_EVERY_S if waiting else 0)

    def start_all(self) -> list[Pod]:
        """Every workload at its `replicas`, all at once as `kubectl apply` would (an instance
        retries its schedulers and the MM Store until they answer); until every pod is ready.
        StatefulSets first: their pods' DNS names resolve before an instance's argv names them."""
        self.prepare()
        pods = [self.start_pod(obj) for obj in self.workloads("StatefulSet") + self.workloads("Deployment")
                for _ in range(obj["spec"]["replicas"])]
        self.wait_ready(pods)
        return pods

    def replace(self, pod: Pod) -> Pod:
        """What a Deployment does for a pod that died: a new pod of the template (new name, new IP)."""
        assert not pod.alive()
        return self.start_pod(pod.workload)

    def close(self) -> None:
        for p in self.pods:
            p.kill()

    def __enter__(self) -> LoopbackCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _template_hash(workload: dict) -> str:
    digest = hashlib.sha256(json.dumps(workload["spec"]["template"], sort_keys=True).encode()).hexdigest()
    return digest[:10]

"""Kubernetes manifests of an epdserve deployment, rendered in Python from the mode table.

`render(KubeValues(...))` (render.py) returns every object as a dict; `epdserve k8s render`
(cli.py) writes them as YAML. The modules, one object family each:

- `values`: `KubeValues`, every choice of a release (mode and counts, flavour, image, model
  volume, MM Store, secrets, autoscaling), validated; its fields are the command's flags;
- `ports`: the one place container ports are written down;
- `flavours`: cpu / cuda / ascend: device, device-plugin resource, image, command, sizes;
- `meta`: object names, labels, the schedulers' pod DNS names and the MM Store URL;
- `secrets`: which Secret key becomes which environment variable; the generated Secret;
- `pod`: security contexts, model volume and demo-model init container, downward API, gRPC probes;
- `scheduler`: the scheduler StatefulSet, its public and headless Services, its PodDisruptionBudget;
- `instances`: a Deployment and a PodDisruptionBudget per pool of the mode;
- `mm_store`: the try-out Redis StatefulSet of the MM Store (without an external URL);
- `network`: the NetworkPolicies (internal ports: the release's pods only);
- `monitoring`: the ServiceMonitor of the schedulers' /metrics;
- `autoscale`: a KEDA ScaledObject per role on an `epdserve:` metric;
- `render`: all of the above in apply order, as dicts or YAML;
- `podview`: a container as the kubelet starts it (env filled in, `$(VAR)` expanded), for tests
  and local harnesses;
- `cli`: `epdserve k8s render`.
"""

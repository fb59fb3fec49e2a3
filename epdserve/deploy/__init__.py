"""Deploying epdserve: the Python that starts a deployment, in one package.

- `local/`: `epdserve launch` — one deployment mode's processes on this machine (private MM Store,
  scheduler, instances), started, supervised and stopped as a whole;
- `kube/`: `epdserve k8s render` — the same modes as Kubernetes manifests, rendered from the mode
  table.

What is not Python stays where the repository's layout puts it: `deploy/` holds the container
images and the rendered manifests (a test keeps them equal to the renderer), `scripts/` the
Atlas cluster scripts, which start the same `epdserve scheduler` / `epdserve instance` processes.
"""

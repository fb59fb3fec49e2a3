"""`epdserve k8s render`: a release's Kubernetes manifests for a mode and flavour, as YAML.

Renders the scheduler (a StatefulSet of >= 2 replicas behind a Service, a PodDisruptionBudget),
one Deployment per pool of the mode (instance/modes.py) requesting one accelerator each, the
NetworkPolicies, a ServiceMonitor, a KEDA ScaledObject per role and, without --mm-store, a
try-out Redis for the MM Store. Secrets are read from the Secret <release>-secrets through env,
never args: created apart by default (the command is printed on stderr), or rendered with random
values by --secrets generate. Nothing is applied; pipe it to `kubectl apply -f -`.
README "Deploy on Kubernetes" says what each object is for.
"""
from __future__ import annotations

import sys

from epdserve.commands import add_command


def add_parser(subparsers):
    from epdserve.deploy.kube.values import KubeValues
    from epdserve.settings import add_flags

    p = subparsers.add_parser("k8s", help="Kubernetes manifests of a deployment mode",
                              description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="k8s_command", required=True, metavar="COMMAND")
    r = add_command(sub, "render", run, "write a release's manifests as YAML", __doc__)
    add_flags(r, KubeValues)
    r.add_argument("--out", default="-", help="file to write (default: standard output)")
    return p


def run(args) -> int:
    from epdserve.deploy.kube.render import render, to_yaml
    from epdserve.deploy.kube.secrets import create_command
    from epdserve.deploy.kube.values import KubeValues
    from epdserve.settings import from_flags

    try:
        values = from_flags(KubeValues, args)
    except ValueError as e:
        print(f"epdserve k8s render: {e}", file=sys.stderr)
        return 2
    text = to_yaml(render(values))
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w") as f:
            f.write(text)
    if values.secrets == "external":
        print(f"# the Secret these manifests read, if it does not exist yet:\n# {create_command(values)}",
              file=sys.stderr)
    return 0

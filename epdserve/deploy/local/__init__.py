"""Deploying: one deployment mode's processes on this machine, started and stopped as a whole.

One sentence per module:
- procs.py           child processes that cannot outlive the launcher (own process group, PDEATHSIG)
- deployment.py      one mode's processes: private MM Store, scheduler, instances, in order
- kv_hop.py          which P->D KV hop the instances use: host when a P and a D share an accelerator
- argv.py            a flag's value in a child's argument list, as its argparse reads it
- readiness.py       the launcher's readiness probe (the deployment's own credentials) and what it saw
- supervisor.py      when a dead child is started again: capped backoff, and the crash loop that ends it
- signals.py         how every epdserve process learns it must stop, with no lock in a signal handler
- launcher_process.py `epdserve launch` as another program's child (bench, tests): started, its ready line read, stopped
- launched.py        `launched(mode, model)`: one mode launched for a benchmark or a check, yielded once ready, stopped

`epdserve launch` (entrypoints/launch.py) is its command line; cluster deployments start the
same `epdserve scheduler` / `epdserve instance` processes themselves (scripts/).
"""

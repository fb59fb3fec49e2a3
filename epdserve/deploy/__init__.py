"""Deploying: one deployment mode's processes on this machine, started and stopped as a whole.

One sentence per module:
- procs.py           child processes that cannot outlive the launcher (own process group, PDEATHSIG)
- deployment.py      one mode's processes: private MM Store, scheduler, instances, in order

`epdserve launch` (entrypoints/launch.py) is its command line; cluster deployments start the
same `epdserve scheduler` / `epdserve instance` processes themselves (scripts/).
"""

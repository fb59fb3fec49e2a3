"""One candidate deployment: a mode, its instance pools, and where the instances run.

`PlannedDeployment` holds the mode and the pools of `instance.modes.mode_pools` (the counts `epdserve
launch` takes: `encode`, `prefill`, `decode`). Placement:
- dedicated devices (default): each instance on a device of its own (an NPU, a GPU, a core group
  given to it alone); its co-located workers (EP, ED) share that device;
- colocated host (`colocated_host=True`): every instance shares one device, the whole host at
  the profile's speed. This is `epdserve launch` on one CPU machine without --pin-instances:
  every process's threads run on the same cores, so two instances never both run at full speed.

Degrees (`StageDegrees`: the `--tensor-parallel-size` flags of `epdserve launch`) decide each
pool's tensor-parallel degree by `instance.modes.pool_degrees`, and an instance of degree d takes d
devices: `devices_used` counts devices per instance, not instances. A mode whose P->D pair the
KV hop does not carry at those degrees has no split.

`splits(mode, devices, colocated_host, degrees)` lists the counts that fit: on dedicated devices
the instances' devices number at most `devices`; on a colocated host each pool's ranks number at
most `devices` (the host's core groups bound how many processes are worth running) and E-only
instances beyond the co-located ones at most `devices - 1`.
`launch_config()` is the YAML mapping `epdserve launch --config` reads.
"""
from __future__ import annotations

from dataclasses import dataclass

from epdserve.instance.modes import (DEGREE_FLAGS, Pool, candidate_counts, counts_of_pools, mode_pools, pool_degree,
                                    pool_degrees)
from epdserve.roles import ROLES, STAGES, role_set


@dataclass(frozen=True)
class StageDegrees:
    """The tensor-parallel degrees `epdserve launch` takes (0: `lm`'s, as its flags mean)."""

    lm: int = 1
    encode: int = 1
    prefill: int = 0
    decode: int = 0

    def of(self, pools: list[Pool]) -> list[int]:
        """Each pool's degree; ValueError when the P->D hop does not carry the pair."""
        return pool_degrees(pools, self.lm, self.encode, self.prefill, self.decode)

    @property
    def single(self) -> bool:
        return not self.above_one()

    def above_one(self) -> list[tuple[str, int]]:
        """(stage, degree) of each flag above 1, stages as `instance.modes.DEGREE_FLAGS` names them."""
        return [(k, v) for k, v in (("lm", self.lm), ("encode", self.encode), ("prefill", self.prefill),
                                    ("decode", self.decode)) if v > 1]

    def flags(self) -> str:
        """The flags that differ from one device per instance, e.g. '--prefill-tensor-parallel-size 2'."""
        return " ".join(f"{DEGREE_FLAGS[k]} {v}" for k, v in self.above_one())

    def used(self) -> set[int]:
        """Every degree an instance of some mode takes at these flags (`pool_degree` for each role set)."""
        return {pool_degree(r, self.lm, self.encode, self.prefill, self.decode) for r in ROLES}


@dataclass(frozen=True)
class PlannedDeployment:
    mode: str
    encode: int
    prefill: int
    decode: int
    colocated_host: bool = False
    degrees: StageDegrees = StageDegrees()

    @property
    def pools(self) -> list[Pool]:
        return mode_pools(self.mode, self.encode, self.prefill, self.decode)

    @property
    def num_instances(self) -> int:
        return sum(p.count for p in self.pools)

    def instance_roles(self) -> list[str]:
        """Roles of each instance, in launch order."""
        return [p.roles for p in self.pools for _ in range(p.count)]

    def pool_degrees(self) -> list[int]:
        return self.degrees.of(self.pools)

    def instance_degrees(self) -> list[int]:
        """Each instance's tensor-parallel degree, in launch order."""
        return [d for p, d in zip(self.pools, self.pool_degrees()) for _ in range(p.count)]

    @property
    def devices_used(self) -> int:
        """Devices (or core groups) the deployment takes: each instance as many as its degree."""
        return sum(self.instance_degrees())

    def device_of(self, instance: int) -> int:
        return 0 if self.colocated_host else instance

    @property
    def split(self) -> str:
        """E:P:D as instances of each role (co-located workers counted in both)."""
        roles = self.instance_roles()
        count = {s: sum(1 for r in roles if s in role_set(r).stages) for s in STAGES}
        return ":".join(str(count[s]) for s in STAGES)

    @property
    def summary(self) -> str:
        """The launch ready line's `instances=` text, e.g. EPx1,Dx1."""
        return ",".join(f"{p.roles}x{p.count}" for p in self.pools)

    def launch_config(self, device: str = "cpu") -> dict:
        cfg = {"mode": self.mode, "encode": self.encode, "prefill": self.prefill, "decode": self.decode,
               "device": device}
        for stage, value in self.degrees.above_one():  # the launch setting each flag fills
            cfg[DEGREE_FLAGS[stage].lstrip("-").replace("-", "_")] = value
        if not self.colocated_host and device == "cpu":
            cfg["pin_instances"] = True  # a core group per instance, as the plan assumed
        return cfg


def from_pools(mode: str, pools: dict[str, int], colocated_host: bool = False,
               degrees: StageDegrees = StageDegrees()) -> PlannedDeployment:
    """The deployment whose pools are `pools` ({roles: count}, as in a ready line's `instances=`)."""
    return PlannedDeployment(mode, *counts_of_pools(mode, pools), colocated_host=colocated_host, degrees=degrees)


def parse_summary(text: str) -> dict[str, int]:
    """'EPx1,Dx2' → {'EP': 1, 'D': 2}."""
    out: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        roles, sep, count = part.rpartition("x")
        if not sep or not count.isdigit():
            raise ValueError(f"bad instance count {part!r} (expected ROLESxN)")
        out[roles] = out.get(roles, 0) + int(count)
    return out


def splits(mode: str, devices: int, colocated_host: bool = False,
           degrees: StageDegrees = StageDegrees()) -> list[PlannedDeployment]:
    """Every deployment of `mode` that fits `devices` at `degrees` (see the module docstring)."""
    if devices < 1:
        raise ValueError(f"--devices must be >= 1, got {devices}")
    try:
        degrees.of(mode_pools(mode, 1, 1, 1))  # the degrees depend on the roles only, not on the counts
    except ValueError:  # the mode's P->D pair at these degrees is one the KV hop does not carry
        return []
    out = [PlannedDeployment(mode, *c, colocated_host=colocated_host, degrees=degrees)
           for c in candidate_counts(mode, devices)]
    if colocated_host:
        return out if degrees.single else [d for d in out if all(p.count * g <= devices for p, g in
                                                                   zip(d.pools, d.pool_degrees()))]
    return [d for d in out if d.devices_used <= devices]

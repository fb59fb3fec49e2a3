"""Coupled worker (roles PD or EPD): the whole request in one engine's step loop.

EPD (monolithic) encodes media itself, finding features other requests already stored in the
MM Store; PD (mode E-PD) gets features from separate E instances through the store (prefetch
listener, bounded wait, recompute on a miss). Everything it needs is `StageWorker`'s: submit
an `EngineRequest`, each engine output to the request's handle.
"""
from __future__ import annotations

from epdserve.instance.worker import StageWorker


class CoupledWorker(StageWorker):
    role = "PD"

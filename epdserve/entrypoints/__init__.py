"""epdserve.entrypoints."""

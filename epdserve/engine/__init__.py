"""epdserve.engine."""

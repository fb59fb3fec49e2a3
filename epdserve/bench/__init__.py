"""epdserve.bench."""

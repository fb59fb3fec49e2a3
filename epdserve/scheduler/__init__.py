"""epdserve.scheduler."""

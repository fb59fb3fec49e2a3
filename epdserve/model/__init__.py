"""epdserve.model."""

"""epdserve.ops."""

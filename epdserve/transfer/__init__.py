"""epdserve.transfer."""

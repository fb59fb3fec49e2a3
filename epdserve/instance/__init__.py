"""epdserve.instance."""

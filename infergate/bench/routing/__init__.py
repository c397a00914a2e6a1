"""The routing lab (``infergate bench routing``)."""

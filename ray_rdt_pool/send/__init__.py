"""The sending side: the pool, overflow regions and the objects this process sent."""

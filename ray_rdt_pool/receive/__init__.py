"""The receiving side: arenas, peers, READs in flight, mapped gets."""

"""Pure layer: ints and bytes only (stdlib and msgpack); no torch, Ray or NIXL."""

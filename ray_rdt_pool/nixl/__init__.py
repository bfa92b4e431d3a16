"""The NIXL boundary: the backend protocol and the real agent behind it."""

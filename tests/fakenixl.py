"""The fake NIXL the logic tests use; it ships with the package as ray_rdt_pool.testing."""

# re-exported for the tests until the lead rewires them
from ray_rdt_pool.testing import FakeBackend, World

__all__ = ["FakeBackend", "World"]

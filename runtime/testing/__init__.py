"""runtime.testing."""

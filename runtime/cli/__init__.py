"""runtime.cli."""

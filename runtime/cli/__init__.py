"""paramsync.runtime.cli."""

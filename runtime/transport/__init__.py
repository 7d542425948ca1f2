"""paramsync.runtime.transport."""

"""paramsync.runtime.protocol."""

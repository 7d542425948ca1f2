"""paramsync.runtime.observe."""

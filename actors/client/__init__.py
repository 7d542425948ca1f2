"""paramsync.actors.client."""

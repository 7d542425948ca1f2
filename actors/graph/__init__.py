"""paramsync.actors.graph: a worker's actors (compute, gradient comm, optimizer, data loader), the
messages between them, and the factory a trainer builds them with."""

"""actors.graph."""

"""actors.client."""

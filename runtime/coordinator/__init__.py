"""runtime.coordinator: the coordinator, a sans-I/O core split by concern and its trio shell.

``core`` (the wire messages, events and actions; re-exports ``CoordinatorCore``), ``machine``
(``CoordinatorCore``: composes the parts below), ``run_state`` (the run's transition table),
``step_state`` (the step in flight), ``membership`` (joins, members, epochs), ``negotiation``
(bucket-spec agreement, the response cache), ``commits`` (step ends, the digest verdict),
``liveness`` (heartbeats, deadlines, stalls) and ``service`` (the trio shell).
"""

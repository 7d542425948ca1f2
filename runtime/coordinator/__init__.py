"""paramsync.runtime.coordinator: the coordinator, a sans-I/O core split by concern and its trio
shell.

``core`` (``CoordinatorCore``: dispatches events over its table to handlers that compose the
parts below), ``view`` (``CoordinatorView``: the run, read-only, as ``core.view``), ``run`` (the
run's state and the moves its handlers share: abort, hold, open an epoch), ``clock`` (what a
tick decides), ``events`` (the events that never travel, the actions, model and bucket-spec
helpers), ``run_state`` (the run's transition table), ``step_state`` (the step in flight),
``membership`` (joins, members, epochs), ``negotiation`` (bucket-spec agreement, the response
cache), ``commits`` (step ends, the digest verdict), ``liveness`` (heartbeats, deadlines,
stalls) and ``service`` (the trio shell). The wire messages are declared in
`paramsync.runtime.protocol.messages`.
"""

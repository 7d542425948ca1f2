"""paramsync: an async, actor-model parameter-synchronization runtime for data-parallel PyTorch.

``paramsync.runtime`` is the engine (configuration, transports, collectives, the coordinator)
and ``paramsync.actors`` the worker (the trainers, the DDP wrapper, the torch backend).
"""

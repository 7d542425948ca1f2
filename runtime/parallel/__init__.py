"""3D parallelism's engine side (seed 004): what data x tensor x pipeline parallelism is, as pure
descriptions the workers execute and the coordinator checks.

`actions.py` is the vocabulary of a pipeline schedule (one rank's list of actions, the p2p tags of
its sends and receives). Modules here know tensors and collectives, never models or optimizers:
those are the worker's (`actors.parallel`).
"""

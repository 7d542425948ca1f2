"""3D parallelism's worker side (seed 004): tensor-parallel layers, pipeline stages executing
their schedule's action lists, ZeRO-1, activation checkpointing, the 3D trainer.

Built on the engine's descriptions (`paramsync.runtime.parallel`) and collectives (process groups,
the device mesh, tagged point-to-point).
"""

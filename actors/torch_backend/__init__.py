"""paramsync as a torch.distributed backend: ``init_process_group("paramsync")``.

Lowest first: `calls` (what one torch call is, as the coordinator compares it; pure), `ops`
(torch's collectives written with paramsync's), `inner` and `inner_ops` (the inner torch group
a group hands bytes to in the wrapper mode, and the collectives on it), `tree` (whether a
group runs one coordinator or the coordinator tree, from what every rank published in its
store), `session` (a group's coordinator or its part of the tree, client, meshes and executor
in the backend's trio loop), `proof` (the
identical-state proof for torch DDP, FSDP2, HSDP and tensor parallelism, with `proof_targets`,
`proof_digest` and `proof_notice`), `not_parallel` (the refusal of a run whose ranks step
optimizers but never reduce) and `process_group` (the
`torch.distributed.ProcessGroup` subclass, whose factory `paramsync.torch_entry` registers at
``import torch`` and imports at the first group).
This package imports nothing on its own.
"""

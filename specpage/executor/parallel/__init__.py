"""Tensor parallelism: one model's forward split over ranks with torch.distributed.

Rank 0 runs the engine (the core, the draft, sampling) and the first shard
of the target; ranks 1..N-1 run only their shard of the target's forward,
as rank 0's commands say (`comm.Command`). Each rank holds its heads' KV for
the same block ids, so the pool and block tables stay one per engine.

- `comm`: the process groups, their timeouts, the collectives the shards
  call and the command channel;
- `layers`: the modules a shard swaps into a DecoderModel (row-parallel
  projections, vocabulary-parallel embedding and head);
- `sharding`: which weights each rank holds, and building its model;
- `worker`: a rank other than 0, from start to exit;
- `ranks`: rank 0's side of starting and watching the local workers.
"""

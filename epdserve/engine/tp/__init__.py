"""Tensor parallelism inside one instance: rank 0 runs the engine and sends each forward's
inputs to the other ranks, every rank computes its share of the LM's heads, MLP columns and
experts, and two all-reduces per layer sum the shares (shard.py: the head map and the degrees
a model takes; group.py: the group and the rank processes; encode_dp.py: the vision encoder
data-parallel over the ranks; shm_reduce.py: the CPU ranks' all-reduce through shared memory;
failure.py: RankFailure). A rank other than 0 is engine/tp_rank.py, above the engine's parts it
runs."""

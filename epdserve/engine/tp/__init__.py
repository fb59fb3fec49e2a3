"""Tensor parallelism inside one instance: rank 0 runs the engine and sends each forward's
inputs to the other ranks, every rank computes its share of the LM's heads, MLP columns and
experts, and two all-reduces per layer sum the shares (shard.py: the head map and the degrees
a model takes; group.py: the group and the rank processes; worker.py: a rank other than 0;
shm_reduce.py: the CPU ranks' all-reduce through shared memory; failure.py: RankFailure)."""

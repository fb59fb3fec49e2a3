"""Tensor parallelism inside one instance: rank 0 runs the engine and sends each forward's
inputs to the other ranks, every rank computes its share of the LM's heads and MLP columns, and
two all-reduces per layer sum the shares (shard.py: the head map and weight slices; group.py:
the group and the rank processes; worker.py: a rank other than 0)."""

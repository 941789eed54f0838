"""Tensor parallelism across processes and machines on torch.distributed
(gloo on the CPU, nccl on CUDA): group.py (the wire), tensor_parallel.py
(rank 0, inside the engine), worker.py (the other ranks), launch.py (starting
and watching rank processes; `tokenmill worker`). The shards themselves are
model/parallel.py."""

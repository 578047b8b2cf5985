"""``--tp-comm``: how the ranks of a CPU tensor-parallel group exchange tensors (parallel/group.py).

auto: shared memory when every rank runs on this host and the CPU kernels load, else the gloo
process group; shm: shared memory or an error; gloo: the process group (TCP, any hosts). CUDA
groups always use NCCL.
"""

TP_COMM_CHOICES = ("auto", "shm", "gloo")
TP_COMM_HELP = ("tensor-parallel collectives: auto (shared memory when every rank is on this host, "
                "else gloo), shm, or gloo; CUDA groups use NCCL")

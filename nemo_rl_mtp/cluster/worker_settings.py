"""The environment a local run's workers start with (set by ``ray_cluster.local_start_environment``).
Without Ray, so that benchmarks that stand for a worker can read it where Ray is not installed
(the GPU check's travelling copy)."""

# PyTorch's transparent huge pages for CPU tensors of 2 MB and more: it reads the variable once,
# at a process's first allocation, so it must be in the environment the workers start with. A
# rollout reads its whole KV cache at every decode step: on this project's 2-core VM (32 x 2048)
# an engine rebuilt after rollouts of its own at k = 1 (auto's, after a switch) ran 0.99-1.00 of a
# fixed one with them, 0.96-0.99 without, and a k = 0 step ran 0.96x (two processes, not pinned to
# cores); at short responses 0.98x, the default recipe's steps 1.00x, its peak memory +0.2%
# (docs/results.md, "huge pages").
WORKER_SETTINGS = {"THP_MEM_ALLOC_ENABLE": "1"}

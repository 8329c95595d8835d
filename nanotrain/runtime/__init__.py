"""Small helpers the rooms share at run time, none of which knows the Trainer.

- `exit_codes.py`: the exit codes that tell a scheduler why a run ended;
- `collective_errors.py`: a timed-out collective named with its process group;
- `rng.py`: seeding, and capturing / restoring every random generator of a process;
- `host_copy.py`: small host values copied to the device without a sync;
- `sync_guard.py`: `HostSyncCounter`, which finds host-device synchronizations;
- `profiling.py`: named ranges for profiler traces that cost nothing when not recording;
- `optim_kernels.py`: which torch.optim kernel (fused, foreach, loop) an optimizer runs.
"""

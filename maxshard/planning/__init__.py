"""The planner's arithmetic, with no devices: per-device memory, the collectives of a step per mesh axis, roofline
step times and the fit against a chip's memory (`remat_policy: auto`), and the peaks XLA compiles to check them
against (also for TPU slices ahead of time, with libtpu). `python -m maxshard.plan` prints them for a target."""

"""Pipeline parallelism at run time: point-to-point transfers between stages, the schedules that order every
microbatch's forward and backward on every stage, and the measured timeline. How the layers are cut into stages
is part of the parallel configuration: :mod:`megatron_lite.core.parallel.pipeline_stages`."""

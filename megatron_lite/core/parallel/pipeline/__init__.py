"""Pipeline parallelism: how the layers are cut into stages, point-to-point transfers between stages,
and the schedules that order every microbatch's forward and backward on every stage."""

"""Pipeline parallelism: stage partitioning, point-to-point transfers and schedules."""

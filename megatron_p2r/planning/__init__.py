"""Scale on paper: what every rank of a layout holds, sends and computes, without building it.

Pure accounting over a ``Config`` and a world size, reading the ``ParallelPlan`` (which stages
hold which modules, replicas, reductions, the offload choice) and its tensor specs, which
``tools/plan.py --verify-rank`` checks against a meta-device build of any rank. One module per
concern: ``hardware`` (GPU presets and their nodes: memory, NVMe, CPUs and DRAM), ``host_step``
(the host optimizer step's bandwidth, from presets or a measured calibration), ``memory`` (parameter, gradient, optimizer
and offloaded bytes), ``activations``, ``communication``, ``timing``, ``verdict`` (whether the GPU
and the host tier fit, and by how much not) and ``estimate`` (``make_plan``: the whole run and
days for a token budget). See docs/scale.md for the assumptions.
"""

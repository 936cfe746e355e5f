"""The facts of a parallel layout, computed once and without processes: rank arithmetic
(``ranks``), which module each layer calls (``sharing``), the parameters each rank of a stage
holds (``tensor_specs``), gradient buffers and buckets (``buckets``), the offload choice
(``offload``) and the ``ParallelPlan`` that gathers them."""

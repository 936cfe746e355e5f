"""The facts of a parallel layout, computed once and without processes: rank arithmetic
(``ranks``), which module each layer calls (``sharing``), the tensors each stage holds
(``tensors``), the offload choice (``offload``) and the ``ParallelPlan`` that gathers them."""

"""The Pseudo-to-Real convergence study (``p2r-study``, docs/p2r_study.md): several seeds per arm,
trained on your data, compared paired against real from scratch, written up as a report.

``cli`` (options, work directory, workers), ``identity`` (what a work directory was built from),
``corpus`` and ``heldout`` (the data and the held-out set), ``arms`` and ``runs`` (what is trained),
``timing``, ``analysis`` (pure functions of the records), ``report`` and ``plot``.
"""

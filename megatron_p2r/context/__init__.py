"""Context parallelism: the sequence of each micro-batch split over the ranks of a CP group."""

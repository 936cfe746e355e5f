"""Pseudo-to-Real transforms of a trained model, as pure rules on layers and tensors: delinking
(pseudo -> real) and depth growth. ``megatron_p2r.convert`` applies them to checkpoints; the
share patterns themselves are layout facts (``layout.sharing``)."""

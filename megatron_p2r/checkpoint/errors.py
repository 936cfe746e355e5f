"""The error every checkpoint module raises, so callers catch one type for any unusable checkpoint."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked; the message names the file and the field."""

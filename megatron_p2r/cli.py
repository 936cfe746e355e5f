"""How every entry point ends (``pretrain_m6.py`` and ``tools/*.py``).

Exit status 0: done. 2: bad input -- a flag, a YAML file, a checkpoint, a dataset, a corpus --
reported as one ``error:`` line naming the flag, file or field and what was expected (argparse's
own errors also exit 2). 1: the run failed although its input was good (an OS error such as a
full disk). Only the error types that mean "this input cannot work" are caught here: anything
else is a bug in this project and keeps its traceback.
"""

from __future__ import annotations

import sys
from typing import Callable

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.config import ConfigError

INPUT_ERRORS = (ConfigError, CheckpointError)
BAD_INPUT, RUN_FAILED = 2, 1


def fail(message: str, status: int = BAD_INPUT) -> int:
    print(f"error: {message}", file=sys.stderr)
    return status


def run_tool(body: Callable[[], int]) -> int:
    """``body()``'s exit status, or that of the error it raised, reported as one ``error:`` line."""
    try:
        return body()
    except INPUT_ERRORS as exc:
        return fail(str(exc))
    except OSError as exc:
        return fail(str(exc), RUN_FAILED)

"""Where a converter writes: ``DST.tmp``, renamed to DST only when complete, so a failed or killed
conversion never leaves a DST that looks usable, and SRC is never written into."""
from __future__ import annotations

import contextlib
import os
import shutil
from typing import Iterator

from megatron_p2r.checkpoint.errors import CheckpointError


@contextlib.contextmanager
def staged_output(src: str, src_iter: str, dst: str, force: bool) -> Iterator[str]:
    """Yield an empty ``DST.tmp`` to write into; publish it as DST when the block completes,
    remove it when the block raises. DST is checked first: not inside SRC (or its iteration
    directory ``src_iter``), not a link, empty unless ``force``."""
    tmp = _prepare_destination(src, src_iter, dst, force)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(dst):  # only with --force, checked before anything was written
        shutil.rmtree(dst)
    os.rename(tmp, dst)


def _prepare_destination(src: str, src_iter: str, dst: str, force: bool) -> str:
    a, b = os.path.realpath(src), os.path.realpath(dst)
    for s in {a, os.path.realpath(src_iter)}:
        if b == s or b.startswith(s + os.sep) or s.startswith(b + os.sep):
            raise CheckpointError(f"DST {dst} overlaps SRC {src}; the converter never writes into its source")
    if os.path.islink(dst):
        raise CheckpointError(f"DST {dst} is a symbolic link; pass the directory it points to "
                              f"({os.path.realpath(dst)}) if that is where the result belongs")
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)) and not force:
        raise CheckpointError(f"DST {dst} exists and is not empty; pass --force to replace it")
    tmp = b.rstrip(os.sep) + ".tmp"
    if os.path.islink(tmp) or os.path.isfile(tmp):  # never write through a link planted at DST.tmp
        os.unlink(tmp)
    elif os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    return tmp

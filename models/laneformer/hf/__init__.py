"""Hugging Face side of Laneformer.

``configuration_laneformer.py`` and ``modeling_laneformer.py`` are the remote
code copied into every exported folder (they import only torch and
transformers); the other modules here convert between the training model's
checkpoints and that format.
"""

import contextlib
import os
import shutil
from pathlib import Path

REMOTE_CODE_DIR = Path(__file__).parent
REMOTE_CODE_FILES = ("configuration_laneformer.py", "modeling_laneformer.py")


@contextlib.contextmanager
def atomic_folder(out_dir: Path, overwrite: bool = False):
    """Yield a temporary sibling of ``out_dir``, renamed to it only when the block completes.

    A folder under the final name is therefore never partial, whatever
    interrupts the writer; an existing one is replaced only with ``overwrite``.
    """
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} exists (pass overwrite=True / --overwrite to replace it)")
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)

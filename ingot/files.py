"""Files Ingot writes: their mode.

Outputs are written under a temporary name and renamed into place (nothing half written is left).
The temporary file makers (tempfile.mkstemp, safetensors) create files 0600; the renamed output
gets the mode a plain open() would give it under the user's umask.
"""
from __future__ import annotations

import os


def default_file_mode() -> int:
    """0o666 & ~umask: the mode a new file gets under this process's umask."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask

"""`python -m ingot ...` is the `ingot` command (what `torchrun -m ingot generate ...` runs)."""
import sys

from .cli import main

sys.exit(main())

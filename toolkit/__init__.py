"""raygen's public API: the only names users import.

Heavy modules (ray, transformers, torch kernels) load on first use of the name that needs
them, so ``import toolkit`` stays fast.
"""

# Bound at import (toolkit/generate.py is light; the engine loads on the first call), so the
# name ``toolkit.generate`` is the function and not the submodule of the same name.
from toolkit.generate import generate  # noqa: E402,F401

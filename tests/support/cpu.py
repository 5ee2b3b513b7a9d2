"""What the CPU offers, for the tests whose figures were measured on particular kernels."""

from __future__ import annotations

import pytest
import torch

# AMX tiles: oneDNN's AMX-BF16 and AMX-INT8 kernels (what the row classes were measured on)
AMX = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
needs_amx = pytest.mark.skipif(not AMX, reason="row classes measured on AMX-BF16 kernels only")

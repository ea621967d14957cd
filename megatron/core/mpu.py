"""``megatron.core.mpu``: Megatron's historical name for :mod:`megatron.core.parallel_state` (the same module)."""

import sys

from megatron.core import parallel_state

sys.modules[__name__] = parallel_state

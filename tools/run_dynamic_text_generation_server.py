"""Megatron's name for the dynamic-engine server; this project has one server, and it always uses the dynamic
(continuous-batching) engine. Same flags as tools/run_text_generation_server.py (see its docstring)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run_text_generation_server import main  # noqa: E402

from megatron.training.error_handling import tool_main  # noqa: E402

if __name__ == "__main__":
    tool_main(main)

"""``python -m turnout_flaggems [--exclusive]``: print the policy that tries FlagGems first for every op it
serves (``TURNOUT_OPS="$(python -m turnout_flaggems)" turnout generate ...``); ``--exclusive`` also keeps
turnout's fused decode kernels from taking those ops' place at decode."""

import sys

from turnout_flaggems import prefer_policy

print(prefer_policy(exclusive="--exclusive" in sys.argv[1:]))

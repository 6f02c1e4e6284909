"""``python -m turnout_flaggems``: print the policy that tries FlagGems first for every op it serves
(``TURNOUT_OPS="$(python -m turnout_flaggems)" turnout generate ...``)."""

from turnout_flaggems import prefer_policy

print(prefer_policy())

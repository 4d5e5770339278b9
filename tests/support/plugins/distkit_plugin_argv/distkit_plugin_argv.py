"""A plugin that parses the command line at import, as a script turned module often does.

Imported by ``distkit doctor`` its parser meets ``doctor``, prints its usage and exits 2.
"""

import argparse

from distkit.strategies.ddp import DDPStrategy

parser = argparse.ArgumentParser()
parser.add_argument("--buckets", type=int, default=25)
ARGS = parser.parse_args()  # on purpose: at import, with the importing program's argv


class ArgvStrategy(DDPStrategy):
    """Never reached: the import exits first."""

    name = "argv"

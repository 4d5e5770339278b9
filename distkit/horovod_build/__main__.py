"""``python -m distkit.horovod_build``."""

import sys

from distkit.horovod_build import main

sys.exit(main())

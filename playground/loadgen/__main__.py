"""`python -m playground.loadgen`: the load generator's command line."""

import sys

from playground.loadgen.run import main

sys.exit(main())

import os
import sys

# How long an idle OpenMP thread spins before it sleeps, set before torch loads libgomp. With
# libgomp's default (300,000 spins) the executor's second thread kept spinning through the gap
# between one step and the next, on a core the scheduler and the gateway need just then: on two
# cores each plan reached the executor visibly later. 10,000 still spans the gaps between one
# step's parallel regions (100 spins made every step slower); a user's own setting wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from services.executor.service import main  # noqa: E402 - after the variable is set

sys.exit(main())

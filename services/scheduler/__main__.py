import sys

from services.scheduler.service import main

sys.exit(main())

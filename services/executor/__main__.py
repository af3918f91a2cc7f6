import sys

from services.executor.service import main

sys.exit(main())

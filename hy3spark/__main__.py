import sys

from hy3spark.cli import main

sys.exit(main())

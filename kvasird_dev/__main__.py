import sys

from kvasird_dev.cli import main

sys.exit(main())

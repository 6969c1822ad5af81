import sys

from kvasird.cli import main

sys.exit(main())

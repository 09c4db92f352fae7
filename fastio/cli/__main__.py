import sys

from fastio.cli import main

sys.exit(main())

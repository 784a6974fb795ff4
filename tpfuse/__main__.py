import sys

from tpfuse.cli import main

sys.exit(main())

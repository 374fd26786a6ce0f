import sys

from kvfuse.cli import main

sys.exit(main())

import sys

from memkv.cli import main

sys.exit(main())

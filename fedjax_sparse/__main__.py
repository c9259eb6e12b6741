import sys

from fedjax_sparse.run.cli import main

sys.exit(main())

import sys

from mhar_lit.export.cli import export_main

sys.exit(export_main())

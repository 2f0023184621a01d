import sys

from mhar_lit.generation.cli import generate_main

sys.exit(generate_main())

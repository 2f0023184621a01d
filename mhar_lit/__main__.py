"""`python -m mhar_lit`: see mhar_lit.cli."""

from mhar_lit.cli import main

main()

from mhar_lit.cli import main

main()

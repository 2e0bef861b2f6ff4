"""`python -m andrea_export`: the same command line as `andrea-export`."""

from .cli import main

main()

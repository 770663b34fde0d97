"""`python -m gateway` is the `tailguard` command."""

from gateway.cli import main

main()

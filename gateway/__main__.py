"""`python -m gateway` is the `tailguard` command."""

from gateway.cli import main

if __name__ == "__main__":
    main()

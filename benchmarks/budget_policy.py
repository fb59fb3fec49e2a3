"""The step budget's policies side by side on one engine's steps, without the serving path:

    python benchmarks/budget_policy.py --variants "default,h32b8=32/8,no-budget=off" --loads 1,inf,c4 --rounds 3

The run itself is epdserve/bench/budget_policy.py's (`--help`).
"""
import sys

from epdserve.bench.budget_policy import main

if __name__ == "__main__":
    sys.exit(main())

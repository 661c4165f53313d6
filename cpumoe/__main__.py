"""`python -m cpumoe`: the same as the `cpumoe` command."""
from cpumoe.cli import main

raise SystemExit(main())

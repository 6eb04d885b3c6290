"""``python -m memopt.measure``: measure one training step in this process (see ``main``).

The measuring child process runs this. It calls the package's ``main``, so a workload
that imports memopt.measure.Workload sees the same classes as the measurement.
"""

from memopt.measure import main

if __name__ == "__main__":
    raise SystemExit(main())

"""``python tests/faults/fault_worker.py worker ...``: the Celery command line, with the test-only
``faultcloud`` kind registered first (prefork children inherit the registry)."""

import sys

from cloud_adapters import registry

registry.KINDS["faultcloud"] = registry.KindInfo("fault_backend", "FaultBackend", "Fault-injecting stand-in")

if __name__ == "__main__":
    from celery.__main__ import main

    sys.argv = ["celery", *sys.argv[1:]]
    sys.exit(main())

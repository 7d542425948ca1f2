"""paramsync.runtime.testing: the fault-injection harness: fault wrappers (faults.py), the armed
daemon entry point (faulty_daemon.py) and the SIGKILL trials built on them (fault_trials.py); and
the public fuzzing API: hypothesis strategies for the protocol (strategies.py) and the hostile-peer
machine against a live deployment (hostile.py)."""

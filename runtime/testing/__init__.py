"""runtime.testing: the fault-injection harness: fault wrappers (faults.py), the armed daemon
entry point (faulty_daemon.py) and the SIGKILL trials built on them (fault_trials.py)."""

"""Test harness shared by tests/ and conformance/: a pytest plugin over infergate.procs."""

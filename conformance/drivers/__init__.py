"""Drivers: where the suite's objects live and where its requests go (local or cluster)."""
